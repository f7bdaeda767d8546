"""A RabbitMQ URL whose password holds an unescaped ``/`` (common in base64 passwords): ``dlq`` and
``outbox-relay`` stop with one line saying to percent-encode it, never a traceback quoting the
password's tail (docs/how-to/configure.md, "A deployment in three environment files")."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PASSWORD = "ab/Zm9vYmFy+secret=="
URL = f"amqp://guest:{PASSWORD}@127.0.0.1:5672/"


@pytest.mark.parametrize("argv", [
    ["-c", "from consumer_kit.cli.main import main; main()", "dlq", "list", "orders"],
    ["-c", "from consumer_kit.outbox_relay.cli import main; main()"],
])
def test_an_unescaped_slash_in_the_password_is_a_clear_error_without_the_password(argv: list[str]) -> None:
    env = {**os.environ, "CONSUMER_KIT_BROKER_URL": URL,
           "CONSUMER_KIT_DATABASE_URL": "postgresql://app@127.0.0.1:1/app"}
    result = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=60)
    text = result.stdout + result.stderr
    assert result.returncode == 2, text
    assert "CONSUMER_KIT_BROKER_URL" in text and "percent-encode" in text and "Traceback" not in text
    assert "Zm9vYmFy" not in text and "secret==" not in text
