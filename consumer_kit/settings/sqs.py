"""The ``sqs`` group: the options of an ``sqs://`` broker URL (not environment variables: they
travel with ``CONSUMER_KIT_BROKER_URL``)::

    sqs://[HOST[:PORT]][/ACCOUNT_ID][?region=R&tls=false&wait=S&visibility=S&heartbeat=off&create_queues=true]

``consumer_kit.adapters.sqs.config.SQSConfig.from_url`` parses the URL; this model states each
option's unit, range and default, and the adapter takes its defaults and bounds from here.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from .fields import count, example

MAX_WAIT_SECONDS = 20
"""SQS's longest long poll (``WaitTimeSeconds``)."""

MAX_VISIBILITY_SECONDS = 43_200
"""SQS's longest visibility timeout: 12 hours, counted from the receive."""

URL_OPTION = "sqs://...?{name}="
"""How the reference page names an option of this group."""


class SQSURLOptions(BaseModel):
    """The query options of an ``sqs://`` URL (host, port and account id are its other parts)."""

    model_config = ConfigDict(extra="forbid")

    region: str | None = example(
        "eu-west-1", "The signing region. Unset: the AWS chain (AWS_REGION, AWS_DEFAULT_REGION,"
        " ~/.aws/config).",
    )
    tls: bool = example(
        "false", "https to a custom endpoint (HOST[:PORT]); false: http (ElasticMQ, LocalStack, moto).",
        default=True, rule="must be true or false",
    )
    wait: int = count(
        10, unit="seconds", minimum=0, maximum=MAX_WAIT_SECONDS, example=10,
        description="How long each long poll waits (WaitTimeSeconds). A stopping consumer waits for"
        " its last poll, so this also bounds that part of a shutdown.",
    )
    visibility: int | None = count(
        None, unit="seconds", minimum=1, maximum=MAX_VISIBILITY_SECONDS, example=60,
        description="Peek-lock asked on each receive (VisibilityTimeout). Unset: the queue's own"
        " VisibilityTimeout.",
    )
    heartbeat: bool = example(
        "off", "Extend the visibility of held deliveries before it lapses.",
        default=True, rule="must be true or false",
    )
    create_queues: bool = example(
        "true", "Create a missing work queue and its -dlq with a redrive policy (local development);"
        " default false: queues are infrastructure.",
        default=False, rule="must be true or false",
    )

    @classmethod
    def default(cls, name: str) -> object:
        """The default of option ``name`` (``wait`` -> ``10``)."""
        return cls.model_fields[name].default
