"""Subscription rules: which messages of a topic a subscription takes (SQL and correlation filters).

Imitates Microsoft's *Topic filters and actions*, *Subscription Rule SQL Filter Syntax* and the
SDK's ``CorrelationRuleFilter`` reference:

- a subscription holds named rules; a message is copied into it **once** when any rule's filter
  matches it (rules without actions are OR-ed into a single copy); a subscription without rules
  gets nothing;
- a new subscription has one rule, ``$Default``, with the true filter (every message);
- :class:`CorrelationFilter`: every field given must equal the message's (strings compared
  case-sensitively), AND-ed; ``properties`` match application properties the same way; a field
  or property the message lacks is no match;
- :class:`SqlFilter`: a SQL-92 subset over ``sys.<system property>`` and user (application)
  properties, unprefixed or ``user.``: comparisons (``= <> != > >= < <=``), ``AND``/``OR``/``NOT``,
  ``[NOT] IN (...)``, ``[NOT] LIKE pattern [ESCAPE c]`` (``%`` any run, ``_`` one character),
  ``IS [NOT] NULL``, ``EXISTS(property)``, ``+ - * / %``, string/number/``TRUE``/``FALSE``/``NULL``
  constants. A user property the message lacks is *unknown* (three-valued logic: a comparison with
  it is unknown, and a filter matches only when it is true); a system property this server does
  not know is an error when the filter is made (Azure: "an attempt to access a non-existent system
  property is an error"). Values of different kinds (a string and a number) compare as unknown.

Not imitated: rule actions (``SqlRuleAction``: no annotated copies, no ``RuleName``), the
``$management`` and ATOM rule operations (rules are set by the test through the server), the
limit of 2,000 SQL filters per topic, and sys properties other than those in :data:`SYSTEM_PROPERTIES`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .sections import PROPERTIES, EncodedMessage

DEFAULT_RULE_NAME = "$Default"

# Indexes into the AMQP properties section (AMQP 1.0 section 3.2.4), by Service Bus's names.
_PROPERTY_INDEX = {
    "messageid": 0,
    "to": 2,
    "label": 3,  # the AMQP subject; Service Bus's older name for it
    "subject": 3,
    "replyto": 4,
    "correlationid": 5,
    "contenttype": 6,
    "sessionid": 10,  # the AMQP group-id
    "replytosessionid": 12,  # the AMQP reply-to-group-id
}
SYSTEM_PROPERTIES = frozenset(_PROPERTY_INDEX)
"""``sys.`` names a SQL filter may use here (case-insensitive)."""


def system_property(content: EncodedMessage, name: str) -> Any:
    """The value of the system property ``name`` (see :data:`SYSTEM_PROPERTIES`), None if unset."""
    properties = next((s.value for s in content.sections if s.code == PROPERTIES), None) or []
    index = _PROPERTY_INDEX[name.casefold()]
    value = properties[index] if len(properties) > index else None
    return _plain(value)


def _plain(value: Any) -> Any:
    """An AMQP value as Python compares it: proton's str/int/float subclasses become the base type."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if hasattr(value, "hex") and hasattr(value, "bytes_le"):  # uuid.UUID
        return str(value)
    return value


class Filter:
    """A rule's filter: ``matches(content)`` says whether the message goes into the subscription."""

    def matches(self, content: EncodedMessage) -> bool:
        raise NotImplementedError


class TrueFilter(Filter):
    """Every message (the ``$Default`` rule's filter; ``SqlFilter("1=1")``)."""

    def matches(self, content: EncodedMessage) -> bool:
        return True


class FalseFilter(Filter):
    """No message (``SqlFilter("1=0")``)."""

    def matches(self, content: EncodedMessage) -> bool:
        return False


@dataclass(frozen=True)
class CorrelationFilter(Filter):
    """Exact matches on system properties and application ``properties``, all AND-ed (SDK names:
    ``subject`` is also accepted as ``label``). At least one condition is required."""

    correlation_id: str | None = None
    message_id: str | None = None
    to: str | None = None
    reply_to: str | None = None
    subject: str | None = None
    session_id: str | None = None
    reply_to_session_id: str | None = None
    content_type: str | None = None
    properties: Mapping[str, Any] = field(default_factory=dict)
    label: str | None = None

    def __post_init__(self) -> None:
        if not self._system_conditions() and not self.properties:
            raise ValueError("a correlation filter needs at least one condition")

    def _system_conditions(self) -> dict[str, Any]:
        wanted = {
            "correlationid": self.correlation_id,
            "messageid": self.message_id,
            "to": self.to,
            "replyto": self.reply_to,
            "subject": self.subject if self.subject is not None else self.label,
            "sessionid": self.session_id,
            "replytosessionid": self.reply_to_session_id,
            "contenttype": self.content_type,
        }
        return {name: value for name, value in wanted.items() if value is not None}

    def matches(self, content: EncodedMessage) -> bool:
        for name, value in self._system_conditions().items():
            if not _same(system_property(content, name), value):
                return False
        user = _user_properties(content)
        for name, value in self.properties.items():
            if name not in user or not _same(user[name], value):
                return False
        return True


def _same(found: Any, wanted: Any) -> bool:
    """Equality without Python's ``True == 1``: a bool matches only a bool."""
    if isinstance(found, bool) or isinstance(wanted, bool):
        return isinstance(found, bool) and isinstance(wanted, bool) and found == wanted
    return bool(found == wanted)


def _user_properties(content: EncodedMessage) -> dict[str, Any]:
    return {str(k): _plain(v) for k, v in content.application_properties.items()}


@dataclass(frozen=True)
class Rule:
    """A named subscription rule (no action: actions are not imitated)."""

    name: str
    filter: Filter = field(default_factory=TrueFilter)


def default_rules() -> dict[str, Rule]:
    """What a new subscription starts with: ``$Default``, the true filter."""
    return {DEFAULT_RULE_NAME: Rule(DEFAULT_RULE_NAME)}


def rules_from(rules: Iterable[Rule] | None) -> dict[str, Rule]:
    """A subscription's rules by name (None: the default rule). Raises ValueError on a repeated
    name or a name over 50 characters (Service Bus quotas: entity and rule names)."""
    if rules is None:
        return default_rules()
    found: dict[str, Rule] = {}
    for rule in rules:
        if len(rule.name) > 50:
            raise ValueError(f"rule name {rule.name!r} is longer than 50 characters")
        if rule.name.casefold() in {n.casefold() for n in found}:
            raise ValueError(f"two rules named {rule.name!r}")
        found[rule.name] = rule
    return found


def any_rule_matches(rules: Mapping[str, Rule], content: EncodedMessage) -> bool:
    """Whether ``content`` goes into a subscription with ``rules`` (one copy however many match)."""
    return any(rule.filter.matches(content) for rule in rules.values())


# -- SQL filters ----------------------------------------------------------------------------------

_UNKNOWN = None  # SQL's third truth value (and NULL): a filter matches only on True

_TOKEN = re.compile(
    r"""\s*(?:
        (?P<number>\d+\.\d*(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?|\d+(?:[eE][+-]?\d+)?)
      | (?P<string>'(?:[^']|'')*')
      | (?P<delimited>\[[^\]]+\]|"[^"]+")
      | (?P<name>[A-Za-z_$][A-Za-z0-9_$\-]*)
      | (?P<op><>|!=|>=|<=|[=<>+\-*/%(),.])
    )""",
    re.VERBOSE,
)
_KEYWORDS = {"AND", "OR", "NOT", "IN", "LIKE", "ESCAPE", "IS", "NULL", "EXISTS", "TRUE", "FALSE"}

_Value = Callable[[EncodedMessage], Any]


@dataclass(frozen=True)
class _Token:
    kind: str  # number, string, name, keyword, op, end
    text: str


def _tokens(expression: str) -> list[_Token]:
    found: list[_Token] = []
    position = 0
    stripped = expression.rstrip()
    while position < len(stripped):
        match = _TOKEN.match(stripped, position)
        if match is None or match.end() == position:
            raise ValueError(f"SQL filter: cannot read {stripped[position : position + 20]!r}")
        kind = match.lastgroup or ""
        text = match.group(kind)
        if kind == "name" and text.upper() in _KEYWORDS:
            found.append(_Token("keyword", text.upper()))
        elif kind == "delimited":
            found.append(_Token("name", text[1:-1]))
        else:
            found.append(_Token(kind, text))
        position = match.end()
    found.append(_Token("end", ""))
    return found


class SqlFilter(Filter):
    """A SQL-like condition (see the module docstring). Raises ValueError when ``expression`` is not
    in the subset imitated here, or names an unknown system property."""

    def __init__(self, expression: str) -> None:
        self.expression = expression
        self._tokens = _tokens(expression)
        self._at = 0
        self._predicate = self._or()
        if self._peek().kind != "end":
            raise ValueError(f"SQL filter: unexpected {self._peek().text!r} in {expression!r}")

    def __repr__(self) -> str:
        return f"SqlFilter({self.expression!r})"

    def matches(self, content: EncodedMessage) -> bool:
        return self._predicate(content) is True

    # -- parsing (recursive descent; each method returns a function of the message) --------------

    def _peek(self) -> _Token:
        return self._tokens[self._at]

    def _take(self, kind: str, text: str | None = None) -> _Token | None:
        token = self._peek()
        if token.kind == kind and (text is None or token.text == text):
            self._at += 1
            return token
        return None

    def _expect(self, kind: str, text: str | None = None) -> _Token:
        token = self._take(kind, text)
        if token is None:
            raise ValueError(
                f"SQL filter: expected {text or kind}, found {self._peek().text!r} in {self.expression!r}"
            )
        return token

    def _or(self) -> _Value:
        left = self._and()
        while self._take("keyword", "OR"):
            left = _or(left, self._and())
        return left

    def _and(self) -> _Value:
        left = self._not()
        while self._take("keyword", "AND"):
            left = _and(left, self._not())
        return left

    def _not(self) -> _Value:
        if self._take("keyword", "NOT"):
            inner = self._not()
            return lambda m: not v if isinstance(v := inner(m), bool) else _UNKNOWN
        return self._condition()

    def _condition(self) -> _Value:
        if self._take("keyword", "EXISTS"):
            self._expect("op", "(")
            name, is_user = self._property_name()
            self._expect("op", ")")
            if not is_user:
                getter = self._system(name)
                return lambda m: getter(m) is not None
            return lambda m: name in _user_properties(m)
        left = self._sum()
        if self._take("keyword", "IS"):
            negated = bool(self._take("keyword", "NOT"))
            self._expect("keyword", "NULL")
            return lambda m: (left(m) is None) != negated
        negated = bool(self._take("keyword", "NOT"))
        if self._take("keyword", "IN"):
            self._expect("op", "(")
            choices = [self._sum()]
            while self._take("op", ","):
                choices.append(self._sum())
            self._expect("op", ")")
            return _negate_if(negated, lambda m: _in(left(m), [c(m) for c in choices]))
        if self._take("keyword", "LIKE"):
            pattern = self._sum()
            escape = self._sum() if self._take("keyword", "ESCAPE") else None
            return _negate_if(negated, lambda m: _like(left(m), pattern(m), escape(m) if escape else None))
        if negated:
            raise ValueError(f"SQL filter: NOT must be followed by IN or LIKE here, in {self.expression!r}")
        for operator in ("=", "<>", "!=", ">=", "<=", ">", "<"):
            if self._take("op", operator):
                right = self._sum()
                return _compare(operator, left, right)
        # A bare expression: a boolean property or constant, or the inside of ``( ... )`` that an
        # arithmetic expression goes on with; only a boolean counts as a truth value.
        return left

    def _sum(self) -> _Value:
        left = self._product()
        while (token := self._take("op", "+") or self._take("op", "-")) is not None:
            left = _arithmetic(token.text, left, self._product())
        return left

    def _product(self) -> _Value:
        left = self._unary()
        while (token := self._take("op", "*") or self._take("op", "/") or self._take("op", "%")) is not None:
            left = _arithmetic(token.text, left, self._unary())
        return left

    def _unary(self) -> _Value:
        if self._take("op", "-"):
            inner = self._unary()
            return lambda m: -v if _is_number(v := inner(m)) else _UNKNOWN
        if self._take("op", "+"):
            return self._unary()
        return self._primary()

    def _primary(self) -> _Value:
        token = self._peek()
        if self._take("op", "("):
            # A parenthesised predicate or expression: try the predicate grammar first.
            inner = self._or()
            self._expect("op", ")")
            return inner
        if token.kind == "number":
            self._at += 1
            text = token.text
            number: float | int = float(text) if any(c in text for c in ".eE") else int(text)
            return lambda m: number
        if token.kind == "string":
            self._at += 1
            text = token.text[1:-1].replace("''", "'")
            return lambda m: text
        if token.kind == "keyword" and token.text in ("TRUE", "FALSE", "NULL"):
            self._at += 1
            constant = {"TRUE": True, "FALSE": False, "NULL": None}[token.text]
            return lambda m: constant
        name, is_user = self._property_name()
        if not is_user:
            return self._system(name)
        return lambda m: _user_properties(m).get(name)

    def _property_name(self) -> tuple[str, bool]:
        """``(name, is_user)``: ``sys.X`` is a system property, ``user.X`` and ``X`` user ones."""
        first = self._expect("name").text
        if self._take("op", "."):
            second = self._expect("name").text
            scope = first.casefold()
            if scope == "sys":
                return second, False
            if scope == "user":
                return second, True
            raise ValueError(f"SQL filter: unknown scope {first!r} (sys or user) in {self.expression!r}")
        return first, True

    def _system(self, name: str) -> _Value:
        if name.casefold() not in SYSTEM_PROPERTIES:
            raise ValueError(
                f"SQL filter: no system property sys.{name} (known: {sorted(SYSTEM_PROPERTIES)})"
            )
        return lambda m: system_property(m, name)


def _negate_if(negated: bool, predicate: _Value) -> _Value:
    if not negated:
        return predicate
    return lambda m: not v if isinstance(v := predicate(m), bool) else _UNKNOWN


def _or(left: _Value, right: _Value) -> _Value:
    def evaluate(m: EncodedMessage) -> bool | None:
        a, b = left(m), right(m)
        if a is True or b is True:
            return True
        if a is False and b is False:
            return False
        return _UNKNOWN

    return evaluate


def _and(left: _Value, right: _Value) -> _Value:
    def evaluate(m: EncodedMessage) -> bool | None:
        a, b = left(m), right(m)
        if a is False or b is False:
            return False
        if a is True and b is True:
            return True
        return _UNKNOWN

    return evaluate


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _comparable(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return False
    if _is_number(a) and _is_number(b):
        return True
    return type(a) is type(b)


def _compare(operator: str, left: _Value, right: _Value) -> _Value:
    def evaluate(m: EncodedMessage) -> bool | None:
        a, b = left(m), right(m)
        if not _comparable(a, b):
            return _UNKNOWN
        if operator == "=":
            return bool(a == b)
        if operator in ("<>", "!="):
            return bool(a != b)
        if isinstance(a, bool):
            return _UNKNOWN  # booleans are not ordered
        return bool({">": a > b, ">=": a >= b, "<": a < b, "<=": a <= b}[operator])

    return evaluate


def _arithmetic(operator: str, left: _Value, right: _Value) -> _Value:
    def evaluate(m: EncodedMessage) -> Any:
        a, b = left(m), right(m)
        if not (_is_number(a) and _is_number(b)):
            return _UNKNOWN
        if operator in "/%" and b == 0:
            return _UNKNOWN
        if operator == "/":
            return a // b if isinstance(a, int) and isinstance(b, int) else a / b
        return {"+": a + b, "-": a - b, "*": a * b, "%": a % b}[operator]

    return evaluate


def _in(value: Any, choices: list[Any]) -> bool | None:
    if value is None:
        return _UNKNOWN
    return any(_comparable(value, c) and value == c for c in choices)


def _like(value: Any, pattern: Any, escape: Any) -> bool | None:
    if not isinstance(value, str) or not isinstance(pattern, str):
        return _UNKNOWN
    if escape is not None and (not isinstance(escape, str) or len(escape) != 1):
        raise ValueError("SQL filter: ESCAPE takes one character")
    regex = []
    characters = iter(pattern)
    for character in characters:
        if escape is not None and character == escape:
            regex.append(re.escape(next(characters, "")))
        elif character == "%":
            regex.append(".*")
        elif character == "_":
            regex.append(".")
        else:
            regex.append(re.escape(character))
    return re.fullmatch("".join(regex), value, re.DOTALL) is not None
