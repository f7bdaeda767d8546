"""The ``Idempotency-Key`` request header: one RFC 9651 String, in a published format.

Rules, from draft-ietf-httpapi-idempotency-key-header-07 ("the draft"):

* section 2.1 "Syntax": the field is an Item Structured Header whose value MUST be a String
  (RFC 9651 section 3.3.3, ``sf-string``): ``Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"``;
  a client MUST NOT send more than one ``Idempotency-Key`` field;
* section 5 "Security Considerations": establish a fixed format for the key, publish it, and
  validate every key against it before processing the request (an unchecked key reaching a lookup
  invites injection; a low-entropy key invites guessing).

So a key is refused, before any lookup, when the field is absent (:class:`MissingKey`), appears
more than once, is not exactly one sf-string (a bare token, a list, trailing text, parameters),
or its value does not match the :class:`KeyFormat` (:class:`MalformedKey`). The draft defines no
parameters for the field, so ``"key";p=1`` is refused rather than silently read as ``"key"``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from consumer_kit.errors import ConfigurationError, MalformedKey, MissingKey
from consumer_kit.identity import MAX_KEY_BYTES, utf8_bytes

IDEMPOTENCY_KEY_HEADER = "Idempotency-Key"


@dataclass(frozen=True)
class KeyFormat:
    """The published format of an idempotency key: a regular expression the whole key must match,
    and the sentence that publishes it (in every 400 about a malformed key and in the policy).

    The default, 16 to 255 characters of ``A-Z a-z 0-9 - . _ ~`` (RFC 3986 "unreserved"), takes a
    UUID (36), a ULID (26), or 16+ characters of a random base64url string, and refuses short,
    guessable keys (draft section 5). :data:`UUID_KEYS` accepts exactly one textual UUID. Whatever
    the pattern, a key longer than 512 bytes of UTF-8 (the ledger's limit,
    :data:`consumer_kit.identity.MAX_KEY_BYTES`) is refused.

    Raises (on construction):
        ConfigurationError: ``pattern`` is not a valid regular expression.
    """

    pattern: str = r"[A-Za-z0-9._~-]{16,255}"
    description: str = (
        "16 to 255 characters of A-Z a-z 0-9 - . _ ~ (a UUID, a ULID or another random identifier), "
        'sent as a Structured Field String: Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"'
    )
    _compiled: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            compiled = re.compile(self.pattern)
        except re.error as exc:
            raise ConfigurationError(f"KeyFormat pattern {self.pattern!r}: {exc}") from None
        object.__setattr__(self, "_compiled", compiled)

    def check(self, key: str) -> str:
        """Return ``key`` when it matches this format.

        Raises:
            MalformedKey: it does not (the detail names the rule, never the key).
        """
        if utf8_bytes(key) > MAX_KEY_BYTES or self._compiled.fullmatch(key) is None:
            raise MalformedKey(f"Idempotency-Key must be {self.description}")
        return key


UUID_KEYS = KeyFormat(
    pattern=r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    description='one UUID in its 36-character text form: Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"',
)
"""Keys that are exactly one textual UUID (RFC 9562), the draft's own example."""


def idempotency_key(field_values: Sequence[str], key_format: KeyFormat) -> str:
    """The idempotency key of a request whose ``Idempotency-Key`` field lines are ``field_values``
    (``request.headers.getlist("Idempotency-Key")``), validated against ``key_format``.

    Raises:
        MissingKey: no such field.
        MalformedKey: more than one field line, not exactly one sf-string, or a value outside
            ``key_format``.
    """
    if not field_values:
        raise MissingKey(f"this operation requires an {IDEMPOTENCY_KEY_HEADER} request header")
    if len(field_values) > 1:
        raise MalformedKey(
            f"a request carries at most one {IDEMPOTENCY_KEY_HEADER} field (draft section 2.1); "
            f"this one has {len(field_values)}"
        )
    return key_format.check(parse_sf_string(field_values[0]))


def parse_sf_string(field_value: str) -> str:
    """The value of a field holding one RFC 9651 String and nothing else (section 4.2: leading
    and trailing spaces are discarded; section 4.2.5 "Parsing a String": a DQUOTE, then printable
    ASCII where ``\\"`` and ``\\\\`` are the only escapes, then a DQUOTE).

    Raises:
        MalformedKey: anything else (a bare token, an unterminated string, a control or non-ASCII
            character, a bad escape, parameters or a second member after the string).
    """
    text = field_value.strip(" ")
    if not text.startswith('"'):
        raise MalformedKey(
            f'{IDEMPOTENCY_KEY_HEADER} must be a Structured Field String in double quotes, e.g. '
            f'{IDEMPOTENCY_KEY_HEADER}: "8e03978e-40d5-43e8-bc93-6894a57f9324" (draft section 2.1, RFC 9651 3.3.3)'
        )
    chars: list[str] = []
    position = 1
    while position < len(text):
        char = text[position]
        position += 1
        if char == "\\":
            if position == len(text) or text[position] not in '"\\':
                raise MalformedKey(f'{IDEMPOTENCY_KEY_HEADER}: only \\" and \\\\ may be escaped (RFC 9651 4.2.5)')
            chars.append(text[position])
            position += 1
        elif char == '"':
            rest = text[position:].lstrip(" ")
            if rest.startswith(";"):
                raise MalformedKey(f"{IDEMPOTENCY_KEY_HEADER} takes no parameters (the draft defines none)")
            if rest:
                raise MalformedKey(f"{IDEMPOTENCY_KEY_HEADER} must hold exactly one String (draft section 2.1)")
            return "".join(chars)
        elif not " " <= char <= "~":
            raise MalformedKey(
                f"{IDEMPOTENCY_KEY_HEADER} holds a control or non-ASCII character (RFC 9651 4.2.5)"
            )
        else:
            chars.append(char)
    raise MalformedKey(f"{IDEMPOTENCY_KEY_HEADER}: the String has no closing double quote (RFC 9651 4.2.5)")
