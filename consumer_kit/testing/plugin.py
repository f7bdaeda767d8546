"""pytest plugin registered by the ``consumer-kit`` distribution (entry point ``pytest11``)."""
