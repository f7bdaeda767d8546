"""Broker adapters: one package per broker (``consumer_kit.adapters.rabbitmq``, ...), ``consumer_kit.adapters.memory`` for
tests and the demo. Each implements ``consumer_kit.broker`` and imports its SDK only inside itself."""
