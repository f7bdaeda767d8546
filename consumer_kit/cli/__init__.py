"""The ``consumer-kit`` command (typer): ``main`` builds it from one module per command group,
``console`` holds what it shares with ``outbox-relay`` (logging set-up, settings, one-line errors)."""
