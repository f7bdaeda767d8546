"""``--processes N``: run N worker processes under one supervisor.

The supervisor starts each child as ``python -m consumer_kit worker APP --processes 1``, forwards
SIGTERM/SIGINT to all of them, restarts a child that dies on its own (with a growing pause, so a
child that cannot start does not spin), and exits 0 once every child has stopped after a shutdown
signal.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from consumer_kit.resilience.backoff import Backoff

logger = logging.getLogger("consumer_kit.supervisor")

MAX_RESTART_PAUSE = 30.0  # seconds
_RESTART = Backoff(first=0.5, cap=MAX_RESTART_PAUSE)  # between restarts of a child that keeps dying
_RESTART = Backoff(first=0.5, cap=MAX_RESTART_PAUSE)  # between restarts of a child that keeps dying


class Supervisor:
    """Keeps ``processes`` copies of ``command`` running until told to stop.

    Args:
        command: argv of one child.
        processes: how many children.
        env: environment for the children (default: this process's).
        stop_timeout: seconds a child gets after SIGTERM before SIGKILL.
    """

    def __init__(
        self,
        command: Sequence[str],
        processes: int,
        *,
        env: dict[str, str] | None = None,
        stop_timeout: float = 45.0,
    ) -> None:
        self.command = list(command)
        self.processes = processes
        self.env = env
        self.stop_timeout = stop_timeout
        self.restarts = 0
        self._stopping = threading.Event()
        self._children: dict[int, subprocess.Popen[bytes]] = {}
        self._failures: dict[int, int] = {}

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Forward ``signum`` to every child and stop restarting them."""
        self._stopping.set()
        for child in self._children.values():
            if child.poll() is None:
                child.send_signal(signum)

    def run(self) -> int:
        """Run until stopped; returns the exit code for the supervisor (0 after a clean stop)."""
        signal.signal(signal.SIGTERM, lambda signum, _frame: self.stop(signum))
        signal.signal(signal.SIGINT, lambda signum, _frame: self.stop(signal.SIGTERM))
        for slot in range(self.processes):
            self._spawn(slot)
        while not self._stopping.is_set():
            for slot, child in list(self._children.items()):
                code = child.poll()
                if code is None or self._stopping.is_set():
                    continue
                self._failures[slot] = self._failures.get(slot, 0) + 1
                pause = _RESTART.delay(self._failures[slot])
                logger.warning("worker %s (pid %s) exited with %s; restarting in %.1f s", slot, child.pid, code, pause)
                if self._stopping.wait(pause):
                    break
                self.restarts += 1
                self._spawn(slot)
            self._stopping.wait(0.2)
        return self._wait_for_children()

    def _spawn(self, slot: int) -> None:
        child = subprocess.Popen(self.command, env=self.env)
        self._children[slot] = child
        logger.info("worker %s started (pid %s)", slot, child.pid)

    def _wait_for_children(self) -> int:
        deadline = time.monotonic() + self.stop_timeout
        worst = 0
        for slot, child in self._children.items():
            try:
                code = child.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.error("worker %s (pid %s) ignored SIGTERM; killing it", slot, child.pid)
                child.kill()
                code = child.wait()
            worst = worst or (code if code not in (0, -signal.SIGTERM) else 0)
        logger.info("all workers stopped")
        return worst


def worker_command(app_path: str, extra: Sequence[str] = ()) -> list[str]:
    """argv that runs one worker process for ``app_path``."""
    return [sys.executable, "-m", "consumer_kit", "worker", app_path, "--processes", "1", *extra]


def child_environment(database_url: str) -> dict[str, str]:
    """This environment with the resolved database URL pinned, so children share one database."""
    env = dict(os.environ)
    env["CONSUMER_KIT_DATABASE_URL"] = database_url
    return env
