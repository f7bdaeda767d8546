"""The embedded PostgreSQL as root (a fresh container): the server runs as the existing account
``nobody`` in a private directory of its own; no system user is created, no parent directory is
opened up, the last process to leave stops it, and a private directory someone else planted is
refused. Each scenario runs in processes of its own, as a user's commands do."""

from __future__ import annotations

import hashlib
import os
import pwd
import shutil
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from consumer_kit.db.embedded_root import private_dir_for

pytestmark = pytest.mark.skipif(not (hasattr(os, "geteuid") and os.geteuid() == 0),
                                reason="the root route is taken as root only")

ROOT = Path(__file__).resolve().parents[2]

# A process that uses the embedded server of DATA_DIR: prints the URL, the uid its backend runs as
# and the server's data directory, then waits for a line on stdin (or for EOF) before it exits.
USER = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    import psycopg
    from consumer_kit.db.embedded import embedded_database_url
    url = embedded_database_url(Path(sys.argv[1]), throwaway=sys.argv[2] == "throwaway")
    with psycopg.connect(url, autocommit=True) as conn:
        pid, data = conn.execute("SELECT pg_backend_pid(), current_setting('data_directory')").fetchone()
        print(url, os.stat(f"/proc/{pid}").st_uid, data, flush=True)
    sys.stdin.readline()
""")


def system_state() -> dict[str, str]:
    """What must not change: the account databases."""
    return {name: hashlib.sha256(Path(name).read_bytes()).hexdigest()
            for name in ("/etc/passwd", "/etc/group", "/etc/shadow") if Path(name).exists()}


def modes(path: Path) -> dict[Path, int]:
    return {p: p.stat().st_mode for p in (path, *path.parents) if p.exists()}


def start_user(data_dir: Path, mode: str = "keep") -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONSUMER_KIT_")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.Popen([sys.executable, "-c", USER, str(data_dir), mode], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def first_line(process: subprocess.Popen[str]) -> list[str]:
    assert process.stdout is not None
    line = process.stdout.readline()  # bounded by the server's start (pg_ctl -w -t 60)
    assert line, process.communicate(timeout=60)[1]
    return line.split()


def finish(process: subprocess.Popen[str]) -> None:
    _, errors = process.communicate("\n", timeout=60)
    assert process.returncode == 0, errors


def postmaster_alive(private: Path) -> bool:
    try:
        pid = int((private / "data" / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]


@pytest.fixture
def data_dir(tmp_path: Path) -> Iterator[Path]:
    """A data directory under pytest's own temp folder, whose parents ``nobody`` cannot pass
    (``/tmp/pytest-of-root`` is mode 0700): the case of a clone in ``/root``."""
    path = tmp_path / "project" / ".consumer-kit" / "pgdata"
    yield path
    shutil.rmtree(private_dir_for(path), ignore_errors=True)


@pytest.mark.slow
def test_as_root_the_server_runs_as_nobody_and_changes_nothing_outside_its_private_directory(
    data_dir: Path,
) -> None:
    before, parent_modes = system_state(), modes(data_dir.parent.parent)
    assert not os.stat(data_dir.parents[2]).st_mode & stat.S_IXOTH  # nobody could not reach data_dir
    user = start_user(data_dir)
    url, uid, server_data = first_line(user)
    private = private_dir_for(data_dir.resolve())
    assert int(uid) == pwd.getpwnam("nobody").pw_uid  # the backend is not root
    assert Path(server_data) == private / "data" and url.endswith(f"?host={private / 'data'}")
    info = os.lstat(private)
    assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (0, 0o711)
    assert stat.S_IMODE(os.stat(private / "data").st_mode) == 0o700
    finish(user)
    assert not postmaster_alive(private)  # the last process out stopped it
    assert system_state() == before  # no system user or group created
    assert modes(data_dir.parent.parent) == parent_modes  # no parent directory opened up
    assert not data_dir.exists()  # nothing written where nobody could not go

    again = start_user(data_dir)  # the data is kept: the next run starts it again
    assert first_line(again)[2] == server_data
    finish(again)


@pytest.mark.slow
def test_the_server_stays_while_another_process_uses_it_and_a_throwaway_one_is_removed(data_dir: Path) -> None:
    first = start_user(data_dir, "throwaway")
    url = first_line(first)[0]
    private = private_dir_for(data_dir.resolve())
    second = start_user(data_dir, "throwaway")
    assert first_line(second)[0] == url  # joined, not started twice
    finish(second)
    assert postmaster_alive(private)  # the first one still uses it
    finish(first)
    assert not private.exists()  # the last one stopped it and removed its data


@pytest.mark.parametrize("planted", ["owned by nobody", "writable by others", "a symbolic link"])
def test_a_private_directory_that_is_not_roots_own_is_refused_and_left_alone(
    data_dir: Path, tmp_path: Path, planted: str,
) -> None:
    private = private_dir_for(data_dir.resolve())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if planted == "a symbolic link":
        private.symlink_to(elsewhere)
    else:
        private.mkdir()
        if planted == "owned by nobody":
            account = pwd.getpwnam("nobody")
            os.chown(private, account.pw_uid, account.pw_gid)
        else:
            private.chmod(0o777)
    try:
        user = start_user(data_dir)
        _, errors = user.communicate("\n", timeout=60)
        assert user.returncode == 1
        assert f"ConfigurationError: {private} exists but is not root's own private directory" in errors
        assert "CONSUMER_KIT_DATABASE_URL=postgresql://" in errors  # the way out
        contents = list(elsewhere.iterdir()) if planted == "a symbolic link" else list(private.iterdir())
        assert contents == []  # nothing was written into it
    finally:
        if private.is_symlink():
            private.unlink()
        else:
            shutil.rmtree(private, ignore_errors=True)
