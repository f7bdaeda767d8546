"""Broker adapters: one package per broker (``adapters.rabbitmq``, ...), ``adapters.memory`` for
tests and the demo. Each implements ``consumer_kit.broker`` and imports its SDK only inside itself."""
