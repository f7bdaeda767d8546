"""The embedded PostgreSQL for a process that runs as root (a fresh container, ``docker run``, CI).

PostgreSQL refuses to run as root. pgserver's own answer to that (create a system user
``pgserver``, open every parent directory of the data directory and of its binaries to all users)
changes the system, so as root consumer-kit starts the server itself and changes nothing outside
one directory of its own (docs/how-to/install.md, "As root"):

* the server runs as the unprivileged account ``nobody`` (which Debian, Ubuntu, Alpine and the
  official Python images already have); nothing runs as root but this process;
* its home is a *private directory* under the system temp directory, one per configured data
  directory: ``consumer-kit-embedded-<hash>/``, root's, mode 0711 (others may pass, not list);
  inside it ``data/`` (``nobody``'s, mode 0700: the data directory and the Unix socket) and
  ``pg-<pgserver version>/`` (pgserver's PostgreSQL binaries, hard-linked, or copied across file
  systems, so ``nobody`` never needs a way into root's home or virtualenv);
* the server listens on the Unix socket in ``data/`` only (no TCP port); every process that uses
  it registers its pid under a lock, and the last one to exit stops it (``throwaway``: and removes
  the private directory), as pgserver's ``cleanup_mode`` does.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import pwd
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from consumer_kit.errors import ConfigurationError

SERVER_ACCOUNT = "nobody"
"""The existing unprivileged account the server runs as (never created here)."""

PRIVATE_PREFIX = "consumer-kit-embedded-"
SOCKET_PATH_LIMIT = 100
"""Bytes a Unix socket path may have (sun_path is 108 on Linux, 104 on the BSDs)."""
START_TIMEOUT = 60.0
"""Seconds ``pg_ctl start -w`` may take (initdb excluded)."""


@dataclass(frozen=True)
class RootServer:
    """A running server of the root route: its URL and its private directory."""

    url: str
    private_dir: Path


def private_dir_for(data_dir: Path) -> Path:
    """The private directory that stands for ``data_dir`` when run as root."""
    digest = hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:16]
    return _temp_base() / f"{PRIVATE_PREFIX}{digest}"


def start(data_dir: Path, *, throwaway: bool = False) -> RootServer:
    """Start (or join) the server that stands for ``data_dir`` and return it.

    Raises:
        ConfigurationError: no account ``nobody``, pgserver's binaries not found, the private
            directory exists but is not root's own (possibly planted: nothing is used), or
            initdb / pg_ctl failed (the message quotes the server log's last lines).
    """
    account = _account()
    private = private_dir_for(data_dir)
    _make_private_dir(private)
    data = private / "data"
    with _locked(private):
        binaries = _binaries(private)
        if not data.exists():
            data.mkdir(mode=0o700)
            os.chown(data, account.pw_uid, account.pw_gid)
        if not (data / "PG_VERSION").exists():
            _run(account, data, [binaries / "initdb", "-D", data, "--auth=trust", "-U", "postgres",
                                 "--encoding=UTF8", "--no-locale", "--no-instructions"])
        if not _running(data):
            _start(account, data, binaries)
        pids = _alive(_read_pids(private)) | {os.getpid()}
        _write_pids(private, pids)
    atexit.register(_leave, account, private, binaries, throwaway)
    return RootServer(f"postgresql://postgres@/postgres?host={data}", private)


# -- the private directory ----------------------------------------------------------------------------


def _temp_base() -> Path:
    """The first temp directory that ``nobody`` can pass through (root's ``TMPDIR`` may be private)."""
    for candidate in (tempfile.gettempdir(), "/tmp", "/var/tmp"):
        path = Path(candidate).resolve()
        if path.is_dir() and all(os.stat(p).st_mode & stat.S_IXOTH for p in (path, *path.parents)):
            return path
    raise ConfigurationError("no temp directory that an unprivileged account can reach (tried $TMPDIR, /tmp, /var/tmp)")


def _make_private_dir(private: Path) -> None:
    try:
        private.mkdir(mode=0o711)
    except FileExistsError:
        pass
    info = os.lstat(private)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o022:
        raise ConfigurationError(f"{private} exists but is not root's own private directory (mode 0711): "
                                 "remove it, or set CONSUMER_KIT_EMBEDDED_DATA_DIR to another directory")
    os.chmod(private, 0o711)  # mkdir's mode passes through the umask


@contextlib.contextmanager
def _locked(private: Path) -> Iterator[None]:
    """One process at a time initialises, starts, joins or stops the server of ``private``."""
    fd = os.open(private / "lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _binaries(private: Path) -> Path:
    """pgserver's ``bin`` folder, linked into ``private`` with the layout its RPATH expects
    (``pgserver/pginstall/bin/../../../pgserver.libs``)."""
    spec = importlib.util.find_spec("pgserver")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigurationError("pgserver is not installed")
    package = Path(next(iter(spec.submodule_search_locations)))
    target = private / f"pg-{importlib.metadata.version('pgserver')}"
    if not target.exists():
        staging = Path(tempfile.mkdtemp(prefix=".pg-", dir=private))
        os.chmod(staging, 0o755)
        for name in ("pgserver/pginstall", "pgserver.libs"):
            source = package.parent / name
            if source.exists():
                shutil.copytree(source, staging / name, symlinks=True, copy_function=_link_or_copy)
        (staging / "pgserver").chmod(0o755)
        staging.rename(target)
    return target / "pgserver" / "pginstall" / "bin"


def _link_or_copy(source: str, destination: str) -> None:
    try:
        os.link(source, destination)
    except OSError:  # another file system
        shutil.copy2(source, destination)


# -- the server ------------------------------------------------------------------------------------------


def _account() -> pwd.struct_passwd:
    try:
        account = pwd.getpwnam(SERVER_ACCOUNT)
    except KeyError:
        raise ConfigurationError(f"as root the embedded PostgreSQL runs as the existing account {SERVER_ACCOUNT!r}, "
                                 "which this system lacks") from None
    if account.pw_uid == 0:
        raise ConfigurationError(f"the account {SERVER_ACCOUNT!r} is root here: PostgreSQL would refuse it")
    return account


def _run(account: pwd.struct_passwd, data: Path, argv: list[Path | str], *, timeout: float = 120.0) -> None:
    """``argv`` as ``account`` in ``data`` (stdout to nowhere: a started server keeps it open)."""
    env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C", "HOME": str(data)}
    with tempfile.TemporaryFile("w+") as errors:
        try:
            subprocess.run([str(a) for a in argv], check=True, cwd=data, env=env, user=account.pw_uid,
                           group=account.pw_gid, extra_groups=[], umask=0o077, stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=errors, timeout=timeout)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            errors.seek(0)
            raise ConfigurationError(f"{Path(str(argv[0])).name} failed in {data}: {_tail(errors.read() + _log(data))}") from exc


def _start(account: pwd.struct_passwd, data: Path, binaries: Path) -> None:
    if len(str(data / ".s.PGSQL.5432").encode()) > SOCKET_PATH_LIMIT:
        raise ConfigurationError(f"the socket path under {data} is too long for a Unix socket")
    # -h '': no TCP port at all; -k: the socket in the data directory, which only nobody can open.
    _run(account, data, [binaries / "pg_ctl", "-D", data, "-w", "-t", str(int(START_TIMEOUT)),
                         "-o", f"-h '' -k {data}", "-l", data / "log", "start"], timeout=START_TIMEOUT + 10)


def _running(data: Path) -> bool:
    """A postmaster whose pid file says ready, and that process alive."""
    try:
        lines = (data / "postmaster.pid").read_text().splitlines()
        pid = int(lines[0])
    except (OSError, ValueError, IndexError):
        return False
    return len(lines) >= 8 and lines[7].strip() == "ready" and _alive({pid}) == {pid}


def _leave(account: pwd.struct_passwd, private: Path, binaries: Path, throwaway: bool) -> None:
    """At exit: unregister this process; the last one stops the server (``throwaway``: and removes
    the private directory)."""
    with contextlib.suppress(ConfigurationError, OSError), _locked(private):
        pids = _alive(_read_pids(private)) - {os.getpid()}
        _write_pids(private, pids)
        if pids:
            return
        data = private / "data"
        if _running(data):
            _run(account, data, [binaries / "pg_ctl", "-D", data, "-w", "-m", "fast", "stop"])
        if throwaway:
            shutil.rmtree(private)


def _read_pids(private: Path) -> set[int]:
    try:
        return {int(p) for p in json.loads((private / "pids.json").read_text())}
    except (OSError, ValueError, TypeError):
        return set()


def _write_pids(private: Path, pids: set[int]) -> None:
    staged = private / "pids.json.new"
    staged.write_text(json.dumps(sorted(pids)))
    staged.replace(private / "pids.json")


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        except PermissionError:
            pass
        alive.add(pid)
    return alive


def _log(data: Path) -> str:
    try:
        return (data / "log").read_text(errors="replace")
    except OSError:
        return ""


def _tail(text: str, lines: int = 5) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:]) or "no output"
