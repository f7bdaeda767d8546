"""Child processes of async tests, always reaped in the event loop that started them.

An asyncio subprocess transport closes only once its process has exited and every pipe it opened
has been read to its end. One left open (a test that failed or timed out before reading) is closed
later by the garbage collector, after its event loop is gone: the ``Event loop is closed`` it raises
then lands in whichever test is running, and at the end of the run fails the run itself.
"""

from __future__ import annotations

import asyncio
import signal


async def reap(proc: asyncio.subprocess.Process) -> tuple[bytes, bytes]:
    """Kill ``proc`` if it still runs and read its pipes to their end; returns ``(stdout, stderr)``
    (``b""`` for a stream that is not a pipe or was read before)."""
    if proc.returncode is None:
        proc.kill()
    out, err = await proc.communicate()
    return out or b"", err or b""


async def communicate(proc: asyncio.subprocess.Process, timeout: float) -> tuple[bytes, bytes]:
    """``proc.communicate()`` within ``timeout`` seconds. Past it, ``proc`` is reaped (killed, its
    pipes read) and :class:`TimeoutError` is raised, naming what it printed on stderr."""
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        _, err = await reap(proc)
        raise TimeoutError(f"still running after {timeout} s (killed); stderr: {err.decode()[-2000:]}") from None
    return out or b"", err or b""


async def stop_gracefully(proc: asyncio.subprocess.Process, timeout: float = 30) -> str:
    """SIGTERM ``proc`` and return its stderr once it exits. Killed if it takes over ``timeout``
    seconds: the text then says so and ``proc.returncode`` is ``-9``."""
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
    try:
        _, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        _, err = await reap(proc)
        return f"[did not stop within {timeout} s of SIGTERM: killed]\n" + err.decode()
    return (err or b"").decode()
