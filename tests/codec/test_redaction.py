"""Secrets never reach a log line, an error or a CLI line, in any form the drivers accept."""

from __future__ import annotations

import pytest

from consumer_kit.codec.redaction import redact, redact_url
from consumer_kit.db.pool import open_pool
from consumer_kit.errors import ConfigurationError
from consumer_kit.settings import Settings

SECRET = "hunter2"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # URL user information (psycopg, aio-pika)
        ("postgresql://app:hunter2@db:5432/app", "postgresql://app:***@db:5432/app"),
        ("amqps://guest:hunter2@rabbit/%2F", "amqps://guest:***@rabbit/%2F"),
        ("amqp://guest:hun@ter2@rabbit/vh", "amqp://guest:***@rabbit/vh"),  # an unencoded @
        # unescaped space, "#", "?", "/" in a password; a token as nats-py takes it; a fragment
        ("amqp://guest:hun ter2@rabbit/vh", "amqp://guest:***@rabbit/vh"),
        ("amqp://guest:hu#nter2@rabbit/vh", "amqp://guest:***@rabbit/vh"),
        ("amqp://guest:hu?nter2@rabbit/vh", "amqp://guest:***@rabbit/vh"),
        ("amqp://guest:a/hunter2+b==@rabbit/vh", "amqp://guest:***@rabbit/vh"),
        ("nats://hunter2@nats:4222", "nats://***@nats:4222"),
        ("tls://hunter2@nats:4222", "tls://***@nats:4222"),
        ("nats://app:hunter2@nats:4222", "nats://app:***@nats:4222"),
        ("postgresql://db/app#password=hunter2", "postgresql://db/app#password=***"),
        ("error at amqp://guest:hunter2@rabbit/vh; see user@example.com", None),
        # URL query parameters (libpq's password=, AWS-style keys)
        ("postgresql://db/app?password=hunter2&sslmode=require", "postgresql://db/app?password=***&sslmode=require"),
        ("postgresql://db/app?sslmode=require&sslpassword=hunter2", "postgresql://db/app?sslmode=require&sslpassword=***"),
        ("sqs://127.0.0.1:4566?aws_secret_access_key=hunter2&region=x", "sqs://127.0.0.1:4566?aws_secret_access_key=***&region=x"),
        # libpq key=value DSNs, quoted values with escapes and spaces around "="
        ("host=db user=app password=hunter2 dbname=app", "host=db user=app password=*** dbname=app"),
        ("host=db password = 'hun ter\\' 2' dbname=app", "host=db password = *** dbname=app"),
        ("PASSWORD=hunter2", "PASSWORD=***"),
        # Service Bus connection strings
        (
            "Endpoint=sb://ns.servicebus.windows.net/;SharedAccessKeyName=Root;SharedAccessKey=hunter2+/=",
            "Endpoint=sb://ns.servicebus.windows.net/;SharedAccessKeyName=Root;SharedAccessKey=***",
        ),
        ("Endpoint=sb://ns/;SharedAccessSignature=SharedAccessSignature sr=x&sig=hunter2", None),
        # nothing secret: unchanged
        ("postgresql://app@db/app", "postgresql://app@db/app"),
        ("user=passwordless dbname=app", "user=passwordless dbname=app"),
        ("Endpoint=sb://ns/;SharedAccessKeyName=Root", "Endpoint=sb://ns/;SharedAccessKeyName=Root"),
    ],
)
def test_every_form_of_secret_is_masked(text: str, expected: str | None) -> None:
    masked = redact(text)
    assert SECRET not in masked
    if expected is not None:
        assert masked == expected


def test_a_url_that_cannot_be_parsed_is_not_shown() -> None:
    assert redact_url("postgresql://app:hunter2@[::1/app") == "<unparsable URL>"
    assert redact_url("postgresql://app:hunter2@h1:5432,h2:x/app") == "<unparsable URL>"


def test_a_multi_host_url_is_shown_redacted() -> None:
    url = "postgresql://app:hunter2@127.0.0.1:5433,127.0.0.1:5434/db?target_session_attrs=read-write"
    assert redact_url(url) == "postgresql://app:***@127.0.0.1:5433,127.0.0.1:5434/db?target_session_attrs=read-write"


@pytest.mark.postgres
@pytest.mark.parametrize(
    "dsn",
    [
        "host=127.0.0.1 port=1 user=app password=hunter2 dbname=app connect_timeout=2",
        "postgresql://app:hunter2@127.0.0.1:1/app?connect_timeout=2",
        "host=127.0.0.1 port=1 password='hunter2",  # a DSN libpq refuses to parse
    ],
)
async def test_the_start_up_error_masks_the_password_of_every_dsn_form(dsn: str) -> None:
    with pytest.raises(ConfigurationError) as raised:
        await open_pool(Settings(), dsn)
    message = str(raised.value)
    assert "cannot connect to PostgreSQL" in message
    assert SECRET not in message
