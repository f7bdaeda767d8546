"""The key that authenticates consumer-kit's own marks on a message, and the signature over them.

A producer can write any header (docs/explanation/trust.md), so the bookkeeping consumer-kit keeps on the
copies it makes (delivery count, suspect mark, original message id, first enqueue time, dead-letter
reason, original queue) is believed only when signed: one HMAC-SHA256 over the marks' names and
values, the operation's identity headers and the SHA-256 of the body, under a key producers do not
have: a signed copy's marks are valid on that one operation only.

The key: the deployment's, created at random by ``consumer-kit migrate`` in the ledger schema's
``mark_keys`` table (every worker, relay and CLI of one deployment shares the database; producers do
not), or set with ``CONSUMER_KIT_MARK_KEY`` (and ``CONSUMER_KIT_MARK_KEY_PREVIOUS`` while rotating:
marks signed under the previous key are still accepted, new ones are signed under the current).
Until one is installed (:func:`install`), the process signs with a random key of its own: its marks
are believed by the process that wrote them only.

Signature format (header ``x-consumer-kit-mac``, 22 characters): the HMAC-SHA256 of the canonical
text (:func:`canonical`) truncated to its first 128 bits (RFC 2104 section 5 allows truncation to
half the output), base64url without padding. It is that short because a copy on a broker with a
small size limit pays for it (SQS counts attribute bytes: 46 here). A reader tries the current key
first (one HMAC), a previous one only while rotating.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

KEY_BYTES = 32
"""The size of a generated key (bytes); a configured one needs at least 16."""
MIN_KEY_BYTES = 16
MAC_CHARS = 22
"""The length of a signature: 128 bits in base64url without padding."""


@dataclass(frozen=True)
class Keyring:
    """The key marks are signed with (``current``) and the keys they are verified with (``current``
    plus ``previous``), by key id; ``source`` says where the current came from (for the log)."""

    current: bytes
    previous: tuple[bytes, ...] = ()
    source: str = "process"


_keyring = Keyring(secrets.token_bytes(KEY_BYTES))


def install(current: bytes, previous: Sequence[bytes] = (), *, source: str = "settings") -> Keyring:
    """Sign with ``current`` from now on and accept marks signed with it or any of ``previous``.

    Raises:
        ValueError: a key shorter than :data:`MIN_KEY_BYTES`.
    """
    global _keyring
    for key in (current, *previous):
        if len(key) < MIN_KEY_BYTES:
            raise ValueError(f"a mark key needs at least {MIN_KEY_BYTES} bytes (got {len(key)})")
    _keyring = Keyring(bytes(current), tuple(bytes(k) for k in previous), source)
    return _keyring


def installed() -> Keyring:
    """The keyring in use."""
    return _keyring


def keyed_digest(context: bytes, *parts: str | int) -> bytes:
    """HMAC-SHA256 (32 bytes) of ``parts`` under the current key, for ids that must be stable
    across the deployment's processes yet unknown to producers (copy ids, event ids). ``context``
    separates the uses; each part is length-prefixed, so no part can shift into its neighbour."""
    text = b"".join(f"{len(str(p))}:{p}\n".encode("utf-8", "surrogatepass") for p in parts)
    return hmac.new(_keyring.current, context + text, hashlib.sha256).digest()


def canonical(marks: Mapping[str, str], body: bytes, identity: Sequence[str] = ()) -> bytes:
    """The text a signature covers: each mark as ``name=value`` (names sorted, one per line), the
    operation's ``identity`` (values in the caller's fixed order, each as ``@value``), then the hex
    SHA-256 of ``body``. Names and values are consumer-kit's own (no newline can occur in a name; a
    value's newline is refused by the codec before it is read), so the text is unambiguous."""
    lines = [f"{name}={marks[name]}" for name in sorted(marks)]
    lines.extend(f"@{value}" for value in identity)
    lines.append(hashlib.sha256(body).hexdigest())
    return "\n".join(lines).encode("utf-8", "surrogatepass")


def sign(marks: Mapping[str, str], body: bytes, identity: Sequence[str] = ()) -> str:
    """The signature of ``marks`` (normalised text values) on a message with ``body`` and the
    operation ``identity`` (:func:`canonical`), under the current key."""
    return _mac(_keyring.current, marks, body, identity)


def verify(signature: str | None, marks: Mapping[str, str], body: bytes, identity: Sequence[str] = ()) -> bool:
    """Whether ``signature`` is a signature of ``marks`` on ``body`` and ``identity`` under a key of the keyring
    (the current one first; constant-time comparison; never raises)."""
    if not signature or len(signature) != MAC_CHARS:
        return False
    ring = _keyring
    return any(hmac.compare_digest(_mac(key, marks, body, identity), signature)
               for key in (ring.current, *ring.previous))


def _mac(key: bytes, marks: Mapping[str, str], body: bytes, identity: Sequence[str] = ()) -> str:
    digest = hmac.digest(key, canonical(marks, body, identity), "sha256")[:16]  # one-shot: C, no HMAC object
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")
