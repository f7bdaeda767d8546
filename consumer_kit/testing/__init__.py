"""Testing kit for users' handlers.

Installing consumer-kit registers the pytest plugin :mod:`consumer_kit.testing.plugin` (fixtures
``consumer_kit_harness``, ``ck_database_url``, ``ck_memory_broker``). The :class:`Harness` runs
your handlers on a throwaway PostgreSQL schema and the memory broker and gives you:

- ``await kit.deliver(message, times=N, concurrently=True)``: a duplicate storm;
- ``kit.crash_at("in_handler")``: arm a crash point (the delivery is left unsettled, the broker
  lock expires, the message comes back);
- ``await kit.replay_all()``: redeliver everything sent so far;
- ``kit.assert_outcomes({"executed": 1, "duplicate": 4})`` and
  ``await kit.assert_one_effect("SELECT count(*) FROM invoices")``.

See ``examples/testing_kit/`` for a test to copy. Names are imported lazily so that the plugin,
which pytest loads in every run, does not pay for the harness.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from consumer_kit.pipeline.crashpoints import CrashPoint
    from consumer_kit.testing.harness import Harness
    from consumer_kit.testing.messages import Sent
    from consumer_kit.testing.outcomes import TERMINAL_OUTCOMES

__all__ = ["TERMINAL_OUTCOMES", "CrashPoint", "Harness", "Sent"]


def __getattr__(name: str) -> Any:
    if name == "CrashPoint":
        from consumer_kit.pipeline.crashpoints import CrashPoint

        return CrashPoint
    if name == "Harness":
        from consumer_kit.testing.harness import Harness

        return Harness
    if name == "Sent":
        from consumer_kit.testing.messages import Sent

        return Sent
    if name == "TERMINAL_OUTCOMES":
        from consumer_kit.testing.outcomes import TERMINAL_OUTCOMES

        return TERMINAL_OUTCOMES
    raise AttributeError(f"module 'consumer_kit.testing' has no attribute {name!r}")
