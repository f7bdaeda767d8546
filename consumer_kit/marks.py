"""The key that authenticates consumer-kit's own marks on a message, and the signature over them.

A producer can write any header (DESIGN.md "Trust"), so the bookkeeping consumer-kit keeps on the
copies it makes (delivery count, suspect mark, original message id, first enqueue time, dead-letter
reason, original queue) is believed only when signed: one HMAC-SHA256 over the marks' names and
values and the SHA-256 of the body, under a key producers do not have.

The key: the deployment's, created at random by ``consumer-kit migrate`` in the ledger schema's
``mark_keys`` table (every worker, relay and CLI of one deployment shares the database; producers do
not), or set with ``CONSUMER_KIT_MARK_KEY`` (and ``CONSUMER_KIT_MARK_KEY_PREVIOUS`` while rotating:
marks signed under the previous key are still accepted, new ones are signed under the current).
Until one is installed (:func:`install`), the process signs with a random key of its own: its marks
are believed by the process that wrote them only.

Signature format (header ``x-consumer-kit-signature``): ``v1.<key id>.<mac>``, where the key id is
the first 8 hex digits of SHA-256 of the key (so a reader computes one HMAC, not one per key) and
the mac the hex HMAC-SHA256 of the canonical text (:func:`canonical`).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

KEY_BYTES = 32
"""The size of a generated key (bytes); a configured one needs at least 16."""
MIN_KEY_BYTES = 16


@dataclass(frozen=True)
class Keyring:
    """The key marks are signed with (``current``) and the keys they are verified with (``current``
    plus ``previous``), by key id; ``source`` says where the current came from (for the log)."""

    current: bytes
    previous: tuple[bytes, ...] = ()
    source: str = "process"

    def by_id(self) -> dict[str, bytes]:
        return {key_id(key): key for key in (*self.previous, self.current)}


def key_id(key: bytes) -> str:
    """The first 8 hex digits of SHA-256 of ``key``: names the key in a signature, reveals nothing."""
    return hashlib.sha256(key).hexdigest()[:8]


_keyring = Keyring(secrets.token_bytes(KEY_BYTES))
_by_id = _keyring.by_id()


def install(current: bytes, previous: Sequence[bytes] = (), *, source: str = "settings") -> Keyring:
    """Sign with ``current`` from now on and accept marks signed with it or any of ``previous``.

    Raises:
        ValueError: a key shorter than :data:`MIN_KEY_BYTES`.
    """
    global _keyring, _by_id
    for key in (current, *previous):
        if len(key) < MIN_KEY_BYTES:
            raise ValueError(f"a mark key needs at least {MIN_KEY_BYTES} bytes (got {len(key)})")
    _keyring = Keyring(bytes(current), tuple(bytes(k) for k in previous), source)
    _by_id = _keyring.by_id()
    return _keyring


def installed() -> Keyring:
    """The keyring in use."""
    return _keyring


def canonical(marks: Mapping[str, str], body: bytes) -> bytes:
    """The text a signature covers: each mark as ``name=value`` (names sorted, one per line), then
    the hex SHA-256 of ``body``. Names and values are consumer-kit's own (no newline can occur in a
    name; a value's newline is refused by the codec before it is read), so the text is unambiguous."""
    lines = [f"{name}={marks[name]}" for name in sorted(marks)]
    lines.append(hashlib.sha256(body).hexdigest())
    return "\n".join(lines).encode("utf-8", "surrogatepass")


def sign(marks: Mapping[str, str], body: bytes) -> str:
    """The signature of ``marks`` (normalised text values) on a message with ``body``, under the
    current key."""
    ring = _keyring
    mac = hmac.new(ring.current, canonical(marks, body), hashlib.sha256).hexdigest()
    return f"v1.{key_id(ring.current)}.{mac}"


def verify(signature: str | None, marks: Mapping[str, str], body: bytes) -> bool:
    """Whether ``signature`` is a signature of ``marks`` on ``body`` under a key of the keyring
    (constant-time comparison; never raises)."""
    if not signature:
        return False
    parts = signature.split(".")
    if len(parts) != 3 or parts[0] != "v1":
        return False
    key = _by_id.get(parts[1])
    if key is None:
        return False
    expected = hmac.new(key, canonical(marks, body), hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, parts[2])
