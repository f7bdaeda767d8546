"""A delivery that passed decoding (steps 2 and 3): its handler, message and operation identity.

:class:`Decoded` is generic in its handler so that this floor need not import the handler API:
the pipeline holds a ``Decoded[Handler[Any]]`` (:data:`consumer_kit.pipeline.decoding.DecodedDelivery`),
while code below the handler API (telemetry) reads it as a ``Decoded[NamedOperation]``.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from pydantic import BaseModel

from consumer_kit.model.identity import OperationIdentity


class NamedOperation(Protocol):
    """The least a decoded delivery's handler has: the type of the operations it runs."""

    @property
    def operation_type(self) -> str: ...


HandlerT_co = TypeVar("HandlerT_co", bound=NamedOperation, covariant=True)


@dataclass(frozen=True)
class Decoded(Generic[HandlerT_co]):
    """A delivery that passed steps 2 and 3: its handler, validated message and identity, its
    ordering key (``None``: unordered) and when its operation was created (``None``: unknown)."""

    handler: HandlerT_co
    message: BaseModel
    identity: OperationIdentity
    partition_key: str | None = None
    operation_time: dt.datetime | None = None
