"""The ``sqs://`` broker URL: which SQS endpoint, and how the adapter uses it.

::

    sqs://[HOST[:PORT]][/ACCOUNT_ID][?region=R&tls=false&wait=S&visibility=S&heartbeat=off&create_queues=true]

=================  =================================================================================
part               meaning
=================  =================================================================================
no host            AWS's own endpoint for the region (``sqs://?region=eu-west-1``)
``HOST[:PORT]``    another endpoint (ElasticMQ, LocalStack, moto, a VPC endpoint); https unless
                   ``tls=false``
``/ACCOUNT_ID``    the account owning queues given by plain name (``QueueOwnerAWSAccountId``)
``region``         the signing region; default: the AWS chain (``AWS_REGION``,
                   ``AWS_DEFAULT_REGION``, ``~/.aws/config``)
``wait``           seconds each long poll waits (``WaitTimeSeconds``, 0 to 20; default 10). A stopping
                   consumer waits for its last poll, so this also bounds that part of a shutdown
``visibility``     seconds of peek-lock asked on each receive (``VisibilityTimeout``, 1 to 43,200);
                   default: the queue's own ``VisibilityTimeout``
``heartbeat``      ``on`` (default): extend the visibility of held deliveries before it lapses
``create_queues``  ``true``: create a missing work queue and its ``-dlq`` with a redrive policy
                   (local development); default ``false``: queues are infrastructure
=================  =================================================================================

Credentials never come from the URL: boto3's standard chain (environment, shared files, SSO,
container or instance roles) supplies them, and nothing in this package logs them. A URL carrying
user info is refused without echoing it.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from consumer_kit.broker.kit.url_options import flag, number, url_options
from consumer_kit.errors import ConfigurationError
from consumer_kit.settings.sqs import MAX_VISIBILITY_SECONDS, MAX_WAIT_SECONDS, SQSURLOptions

__all__ = ["MAX_VISIBILITY_SECONDS", "MAX_WAIT_SECONDS", "SQSConfig"]

_KNOWN = set(SQSURLOptions.model_fields)  # the settings tree's sqs group states each option
_DEFAULT_WAIT = int(str(SQSURLOptions.default("wait")))


@dataclass(frozen=True)
class SQSConfig:
    """What an ``sqs://`` URL says (table in the module docstring).

    Attributes:
        endpoint_url: ``http(s)://host:port`` of a custom endpoint, ``None`` for AWS's own.
        region: signing region, ``None`` for the AWS chain's.
        account_id: owner of queues named by plain name, ``None`` for the caller's account.
        wait_seconds: long-poll wait of each receive (0 to 20 seconds).
        visibility_timeout: seconds asked on each receive; ``None``: the queue's own.
        heartbeat: extend the visibility of held deliveries before it lapses.
        create_queues: create missing work queues and their DLQs.
    """

    endpoint_url: str | None = None
    region: str | None = None
    account_id: str | None = None
    wait_seconds: int = _DEFAULT_WAIT
    visibility_timeout: int | None = None
    heartbeat: bool = bool(SQSURLOptions.default("heartbeat"))
    create_queues: bool = bool(SQSURLOptions.default("create_queues"))

    @classmethod
    def from_url(cls, url: str) -> SQSConfig:
        """Parse an ``sqs://`` URL.

        Raises:
            ConfigurationError: another scheme, user info in the URL, an unknown option or a value
                out of range (the message never repeats the URL's user info).
        """
        parts = urlsplit(url)
        if parts.scheme != "sqs":
            raise ConfigurationError(f"not an sqs:// URL (scheme {parts.scheme!r})")
        if "@" in parts.netloc:
            raise ConfigurationError(
                "sqs:// URLs take no credentials: the AWS credential chain supplies them "
                "(AWS_PROFILE, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a role)"
            )
        options = url_options(parts.query, _KNOWN, scheme="sqs")
        tls = flag(options, "tls", bool(SQSURLOptions.default("tls")), scheme="sqs")
        endpoint = f"{'https' if tls else 'http'}://{parts.netloc}" if parts.netloc else None
        account = parts.path.strip("/") or None
        if account is not None and not (account.isdigit() and len(account) == 12):
            raise ConfigurationError(f"the sqs:// path must be a 12-digit account id, not {account!r}")
        return cls(
            endpoint_url=endpoint,
            region=options.get("region") or None,
            account_id=account,
            wait_seconds=number(
                options, "wait", _DEFAULT_WAIT, 0, MAX_WAIT_SECONDS, scheme="sqs", whole=True, unit="seconds"
            ),
            visibility_timeout=(
                None if "visibility" not in options
                else number(options, "visibility", 1, 1, MAX_VISIBILITY_SECONDS, scheme="sqs", whole=True,
                            unit="seconds")
            ),
            heartbeat=flag(options, "heartbeat", cls.heartbeat, scheme="sqs"),
            create_queues=flag(options, "create_queues", cls.create_queues, scheme="sqs"),
        )

