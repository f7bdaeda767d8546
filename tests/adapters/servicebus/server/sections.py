"""An encoded AMQP message kept as the producer sent it, section by section.

Service Bus never re-encodes a message body: what a consumer receives is the producer's bytes
with a fresh header (delivery count) and the broker's annotations (sequence number, lock...). We do
the same, so bodies, property types and footers come back byte for byte; only the header, the
annotation maps and, for dead-lettering, the application properties are rewritten.

A ``ServiceBusMessageBatch`` arrives as one transfer (message format 0x80013700) whose data
sections are each a whole encoded message; ``unbatch`` opens it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from proton import Data, DataException, Described, uint, ulong

from . import wire

HEADER = 0x70
DELIVERY_ANNOTATIONS = 0x71
MESSAGE_ANNOTATIONS = 0x72
PROPERTIES = 0x73
APPLICATION_PROPERTIES = 0x74
DATA = 0x75
AMQP_SEQUENCE = 0x76
AMQP_VALUE = 0x77
FOOTER = 0x78
_SECTION_CODES = range(HEADER, FOOTER + 1)

# Indexes into the properties section's list (AMQP 1.0 section 3.2.4).
_MESSAGE_ID = 0
_GROUP_ID = 10


@dataclass(frozen=True)
class Section:
    """One message section: its descriptor code, decoded value and the bytes it arrived as."""

    code: int
    value: Any
    raw: bytes


def split_sections(encoded: bytes) -> list[Section] | None:
    """The sections of an encoded message, or None when the bytes are not a sequence of sections."""
    sections: list[Section] = []
    offset = 0
    while offset < len(encoded):
        if not _starts_a_section(encoded, offset):
            return None
        data = Data()
        try:
            consumed = data.decode(encoded[offset:])
        except (DataException, ValueError, OverflowError):  # arbitrary bytes can fail in any of these
            return None
        data.rewind()
        data.next()
        value = wire.detach_buffers(data.get_object())
        if consumed <= 0 or not isinstance(value, Described) or value.descriptor not in _SECTION_CODES:
            return None
        sections.append(Section(int(value.descriptor), value.value, encoded[offset : offset + consumed]))
        offset += consumed
    return sections or None


def _starts_a_section(encoded: bytes, offset: int) -> bool:
    """Whether a section descriptor starts at ``offset``: 0x00 then a (small) ulong 0x70..0x78."""
    head = encoded[offset : offset + 10]
    if head[:2] == b"\x00\x53" and len(head) >= 3:
        return head[2] in _SECTION_CODES
    if head[:2] == b"\x00\x80" and len(head) == 10:
        return int.from_bytes(head[2:10], "big") in _SECTION_CODES
    return False


def unbatch(encoded: bytes) -> list[bytes]:
    """The messages in one transfer: a batch's inner messages, or the message itself.

    The SDK marks batches with message format 0x80013700, which python-qpid-proton does not
    expose; a transfer whose every data section is itself a well-formed message is a batch.
    """
    sections = split_sections(encoded)
    if not sections:
        return [encoded]
    bodies = [s for s in sections if s.code in (DATA, AMQP_SEQUENCE, AMQP_VALUE)]
    if not bodies or any(s.code != DATA for s in bodies):
        return [encoded]
    inner = [bytes(s.value) for s in bodies]
    if all(_is_message(candidate) for candidate in inner):
        return inner
    return [encoded]


def _is_message(candidate: bytes) -> bool:
    sections = split_sections(candidate)
    return bool(sections) and any(s.code in (DATA, AMQP_SEQUENCE, AMQP_VALUE) for s in sections or [])


def encode_section(code: int, value: Any) -> bytes:
    """The bytes of one section with descriptor ``code``."""
    data = Data()
    data.put_object(Described(ulong(code), value))
    return data.encode()


@dataclass(frozen=True)
class EncodedMessage:
    """A message as a producer sent it; ``render`` produces what a consumer receives."""

    sections: tuple[Section, ...]

    @classmethod
    def decode(cls, encoded: bytes) -> EncodedMessage:
        """Raises ValueError when ``encoded`` is not an AMQP message."""
        sections = split_sections(encoded)
        if not sections:
            raise ValueError("not an AMQP message")
        return cls(tuple(sections))

    def _value(self, code: int) -> Any:
        for section in self.sections:
            if section.code == code:
                return section.value
        return None

    def _property(self, index: int) -> Any:
        properties = self._value(PROPERTIES) or []
        return properties[index] if len(properties) > index else None

    @property
    def message_id(self) -> str | None:
        value = self._property(_MESSAGE_ID)
        return None if value is None else str(value)

    @property
    def session_id(self) -> str | None:
        """The AMQP group-id, which Service Bus calls the session id."""
        value = self._property(_GROUP_ID)
        return None if value is None else str(value)

    @property
    def partition_key(self) -> str | None:
        """The ``x-opt-partition-key`` message annotation the SDK sets from ``partition_key``."""
        value = self.annotations.get(wire.PARTITION_KEY)
        return None if value is None else str(value)

    @property
    def time_to_live(self) -> float | None:
        """Seconds, from the AMQP header's ``ttl`` (milliseconds) the producer set; None if not set."""
        header = list(self._value(HEADER) or [])
        value = header[2] if len(header) > 2 else None
        return None if value is None else int(value) / 1000

    @property
    def annotations(self) -> dict[Any, Any]:
        return dict(self._value(MESSAGE_ANNOTATIONS) or {})

    @property
    def application_properties(self) -> dict[Any, Any]:
        return dict(self._value(APPLICATION_PROPERTIES) or {})

    @property
    def body(self) -> bytes:
        """The data sections joined (empty for value or sequence bodies)."""
        return b"".join(bytes(s.value) for s in self.sections if s.code == DATA)

    @property
    def size(self) -> int:
        """Encoded size in bytes, as sent."""
        return sum(len(s.raw) for s in self.sections)

    def encode(self) -> bytes:
        """The bytes as the producer sent them."""
        return b"".join(s.raw for s in self.sections)

    def with_application_properties(self, extra: dict[str, Any]) -> EncodedMessage:
        """A copy whose application properties also hold ``extra`` (dead-letter reason, for example)."""
        merged = {**self.application_properties, **extra}
        replacement = Section(APPLICATION_PROPERTIES, merged, encode_section(APPLICATION_PROPERTIES, merged))
        kept = [s for s in self.sections if s.code != APPLICATION_PROPERTIES]
        # Sections keep their AMQP order: application properties sit before the body.
        position = next((i for i, s in enumerate(kept) if s.code > APPLICATION_PROPERTIES), len(kept))
        kept.insert(position, replacement)
        return EncodedMessage(tuple(kept))

    def render(
        self,
        *,
        delivery_count: int,
        annotations: dict[Any, Any],
        delivery_annotations: dict[Any, Any] | None = None,
        time_to_live: float | None = None,
    ) -> bytes:
        """The bytes a consumer receives: new header (delivery count; ``time_to_live`` seconds, the
        effective one, when finite) and annotations, the rest as sent."""
        header = list(self._value(HEADER) or [])
        header.extend([None] * (5 - len(header)))
        header[4] = uint(delivery_count)
        if time_to_live is not None and math.isfinite(time_to_live):
            header[2] = uint(max(0, round(time_to_live * 1000)))
        parts = [encode_section(HEADER, header)]
        if delivery_annotations:
            parts.append(encode_section(DELIVERY_ANNOTATIONS, delivery_annotations))
        parts.append(encode_section(MESSAGE_ANNOTATIONS, {**self.annotations, **annotations}))
        parts.extend(s.raw for s in self.sections if s.code > MESSAGE_ANNOTATIONS)
        return b"".join(parts)
