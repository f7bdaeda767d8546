"""The ``nats://`` broker URL: which NATS server, and how the adapter uses JetStream.

::

    nats://[USER:PASSWORD@]HOST[:PORT][,HOST2[:PORT]][?ack_wait=S&heartbeat=on&fetch_wait=S&ordered=false&max_deliver=N]

==============  ==================================================================================
part            meaning
==============  ==================================================================================
``HOST:PORT``   the server(s) (default port 4222); user info is passed to the server, never logged
``ack_wait``    seconds of peek-lock (the durable consumer's ``ack_wait``) given to consumers this
                adapter creates or updates (default 30, JetStream's own default)
``heartbeat``   ``on`` (default): ``in_progress()`` keeps held deliveries locked before ack_wait
                lapses
``fetch_wait``  seconds each pull (``fetch``) waits for messages (default 5, 0.1 to 60); a stopping
                consumer waits for its last pull, so this also bounds that part of a shutdown
``ordered``     ``true``: the durable consumer gets ``max_ack_pending=1``: one message of the
                stream in flight at a time, in stream order (per-key order: docs/brokers/nats.md)
``max_deliver`` JetStream's loop guard; default ``max(50, 5 * (max_deliveries + crash_limit))``
==============  ==================================================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from consumer_kit.broker.kit.url_options import flag, number, url_options
from consumer_kit.errors import ConfigurationError

_KNOWN = {"ack_wait", "heartbeat", "fetch_wait", "ordered", "max_deliver"}


@dataclass(frozen=True)
class NATSConfig:
    """What a ``nats://`` URL says (table in the module docstring).

    Attributes:
        servers: the server URL(s) without the query (may carry user info: never log it).
        ack_wait: seconds of peek-lock for consumers this adapter creates or updates.
        heartbeat: renew held deliveries with ``in_progress()``.
        fetch_wait: seconds one pull waits.
        ordered: one message in flight per consumer (``max_ack_pending=1``).
        max_deliver: JetStream's delivery limit, ``None`` for the recommended one.
    """

    servers: tuple[str, ...]
    ack_wait: float = 30.0
    heartbeat: bool = True
    fetch_wait: float = 5.0
    ordered: bool = False
    max_deliver: int | None = None

    @property
    def display(self) -> str:
        """The servers without user info (for logs)."""
        return ",".join(s.rsplit("@", 1)[-1] for s in self.servers)

    @classmethod
    def from_url(cls, url: str) -> NATSConfig:
        """Parse a ``nats://`` URL.

        Raises:
            ConfigurationError: another scheme, no host, an unknown option or a value out of range
                (the message never repeats the URL's user info).
        """
        parts = urlsplit(url)
        if parts.scheme not in ("nats", "tls"):
            raise ConfigurationError(f"not a nats:// URL (scheme {parts.scheme!r})")
        hosts = [h for h in parts.netloc.split(",") if h]
        if not hosts:
            raise ConfigurationError("a nats:// URL names a server: nats://HOST[:PORT]")
        options = url_options(parts.query, _KNOWN, scheme="nats")
        user = hosts[0].rsplit("@", 1)[0] + "@" if "@" in hosts[0] else ""
        servers = tuple(urlunsplit((parts.scheme, h if "@" in h else user + h, "", "", "")) for h in hosts)
        return cls(
            servers=servers,
            ack_wait=number(options, "ack_wait", 30.0, 1.0, 43_200.0, scheme="nats", unit="seconds"),
            heartbeat=flag(options, "heartbeat", True, scheme="nats"),
            fetch_wait=number(options, "fetch_wait", 5.0, 0.1, 60.0, scheme="nats", unit="seconds"),
            ordered=flag(options, "ordered", False, scheme="nats"),
            max_deliver=(
                None if "max_deliver" not in options
                else number(options, "max_deliver", 2, 2, 1_000_000, scheme="nats", whole=True)
            ),
        )

