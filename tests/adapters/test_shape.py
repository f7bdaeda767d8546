"""The one adapter shape the core describes: the adapter modules' factories
(:mod:`consumer_kit.broker.registry`), the one redrive loop (:class:`consumer_kit.broker.dead_letters.Redrive`)
and the one set of counters (:class:`consumer_kit.broker.kit.counters.Counters`). No broker needed."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import types
from importlib.metadata import entry_points, metadata

import pytest

from consumer_kit.broker import DeadLetterQueues, RedriveReport
from consumer_kit.broker.dead_letters import DeadLetter, Redrive, RedriveAsked
from consumer_kit.broker.kit.counters import Counted, Counters
from consumer_kit.broker.registry import GROUP, REQUIRED, adapter_for, check_adapter, open_dead_letters
from consumer_kit.errors import ConfigurationError, CopyRefused, RemoveFailed
from consumer_kit.settings import Settings


def test_every_registered_adapter_module_provides_the_factories() -> None:
    schemes = sorted({ep.name for ep in entry_points(group=GROUP)})
    assert {"memory", "amqp", "sqs", "servicebus", "nats"} <= set(schemes)
    for scheme in schemes:
        module = adapter_for(f"{scheme}://")
        for name in REQUIRED:
            assert callable(getattr(module, name)), (scheme, name)
        assert check_adapter(module, scheme) is module


def test_a_module_without_a_factory_is_refused_by_name() -> None:
    module = types.ModuleType("consumer_kit.adapters.half")
    module.consumer_from_settings = lambda settings: None  # type: ignore[attr-defined]
    with pytest.raises(ConfigurationError) as refused:
        check_adapter(module, "half")
    text = str(refused.value)
    assert "consumer_kit.adapters.half" in text and "publisher_from_settings(settings)" in text
    assert "consumer_from_settings" not in text
    module.publisher_from_settings = "not callable"  # type: ignore[attr-defined]
    with pytest.raises(ConfigurationError, match="publisher_from_settings"):
        check_adapter(module, "half")


def test_an_adapter_without_dead_letters_gets_the_unsupported_base() -> None:
    dead = open_dead_letters(Settings(broker_url="memory://shape"))
    assert type(dead) is DeadLetterQueues


# -- the redrive loop --------------------------------------------------------------------------------


def letter(message_id: str) -> DeadLetter:
    return DeadLetter(queue="q", message_id=message_id, reason="payload_conflict", detail="",
                      delivery_count=1, dead_lettered_at=None, enqueued_at=None, operation_key=None,
                      headers={}, body=b"{}")


class ListRedrive(Redrive[str]):
    """A redrive between two Python lists: what the template asks of an adapter, and no more."""

    def __init__(self, asked: RedriveAsked, dead: list[str], *, refuse: set[str] = frozenset(),
                 stuck: set[str] = frozenset(), broken: set[str] = frozenset()) -> None:
        super().__init__(asked, target="q", source="q.dlq")
        self.dead, self.work = dead, []  # type: list[str], list[str]
        self.refuse, self.stuck, self.broken = refuse, stuck, broken

    async def send_copy(self, message: str, letter: DeadLetter) -> None:
        if message in self.broken:
            raise ConnectionError("gone")
        if message in self.refuse:
            raise CopyRefused("too large")
        self.work.append(message)

    async def remove(self, message: str, letter: DeadLetter) -> None:
        if message in self.stuck:
            raise RemoveFailed("lock lost")
        self.dead.remove(message)


async def test_the_loop_copies_then_removes_and_counts_each_outcome(caplog: pytest.LogCaptureFixture) -> None:
    told: list[tuple[str | None, bool]] = []
    asked = RedriveAsked(lambda found: found.message_id != "keep", progress=lambda found, moved: told.append((found.message_id, moved)))
    dead = ["a", "keep", "big", "stuck"]
    run = ListRedrive(asked, dead, refuse={"big"}, stuck={"stuck"})
    with caplog.at_level(logging.WARNING, logger="consumer_kit.dead_letters"):
        left = [m for m in list(dead) if not await run.look_at(m, letter(m))]
    assert run.report == RedriveReport(redriven=2, kept=1, failed=1)
    assert run.work == ["a", "stuck"] and dead == ["keep", "big", "stuck"]
    assert left == ["keep", "big"]  # "stuck" was sent: it counts as moved although it stays
    assert told == [("a", True), ("keep", False), ("big", False), ("stuck", True)]
    assert "message_id=big to q refused (too large)" in caplog.text
    assert "message_id=stuck to q but could not remove it from q.dlq (lock lost)" in caplog.text


async def test_a_dry_run_counts_and_tells_without_sending() -> None:
    told: list[tuple[str | None, bool]] = []
    asked = RedriveAsked(lambda found: found.message_id == "a", dry_run=True,
                         progress=lambda found, moved: told.append((found.message_id, moved)))
    dead = ["a", "b"]
    run = ListRedrive(asked, dead)
    assert [run.choose(letter(m)) for m in dead] == [False, False]  # nothing to move in a dry run
    assert run.report == RedriveReport(redriven=1, kept=1) and run.work == [] and dead == ["a", "b"]
    assert told == [("a", True), ("b", False)]


async def test_a_failure_that_is_not_a_refusal_stops_the_redrive() -> None:
    dead = ["a", "b"]
    run = ListRedrive(RedriveAsked(lambda found: True), dead, broken={"a"})
    with pytest.raises(ConnectionError):
        await run.look_at("a", letter("a"))
    assert dead == ["a", "b"] and run.report == RedriveReport()


# -- counters --------------------------------------------------------------------------------------


class Counting:
    deletes = Counted()
    retries = Counted()

    def __init__(self) -> None:
        self.counters = Counters(("deletes", "retries"))


def test_counters_start_at_zero_in_order_and_summarise_what_was_counted() -> None:
    counters = Counters(("received", "renewals", "locks_lost"))
    assert counters.snapshot() == {"received": 0, "renewals": 0, "locks_lost": 0}
    counters.add("renewals")
    counters.add("received", 3)
    assert (counters["received"], counters["renewals"], counters["locks_lost"]) == (3, 1, 0)
    assert list(counters.snapshot()) == ["received", "renewals", "locks_lost"]
    assert counters.summary() == "received=3 renewals=1"


def test_a_counted_attribute_lives_in_its_owners_counters() -> None:
    one, other = Counting(), Counting()
    one.deletes += 1
    one.deletes += 1
    other.retries += 1
    assert (one.deletes, one.retries, other.deletes, other.retries) == (2, 0, 0, 1)
    assert one.counters.snapshot() == {"deletes": 2, "retries": 0}
    with pytest.raises(AttributeError):
        _ = Counting.deletes


# -- a missing SDK names its extra ---------------------------------------------------------------

# scheme -> (a module of the adapter's SDK, the extra that installs it)
SDKS = {
    "sqs": ("boto3", "sqs"), "nats": ("nats", "nats"), "amqp": ("aio_pika", "rabbitmq"),
    "amqps": ("aiormq", "rabbitmq"), "servicebus": ("azure.servicebus", "servicebus"), "sb": ("azure.servicebus", "servicebus"),
}

_WITHOUT_SDK = """
import json, sys
from consumer_kit.broker.registry import adapter_for
from consumer_kit.errors import ConfigurationError
said = {}
for scheme, sdk in json.loads(sys.argv[1]).items():
    sys.modules[sdk] = None  # import of it fails, as when the extra is not installed
    try:
        adapter_for(scheme + "://")
        said[scheme] = "loaded"
    except ConfigurationError as exc:
        said[scheme] = str(exc)
    del sys.modules[sdk]
print(json.dumps(said))
"""


def test_an_adapter_whose_sdk_is_missing_names_the_extra_to_install() -> None:
    assert set(SDKS) | {"memory"} == {ep.name for ep in entry_points(group=GROUP)}  # every adapter is tried
    sdks = json.dumps({scheme: sdk for scheme, (sdk, _) in SDKS.items()})
    ran = subprocess.run([sys.executable, "-c", _WITHOUT_SDK, sdks], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    said = json.loads(ran.stdout)
    declared = set(metadata("consumer-kit").get_all("Provides-Extra") or [])
    for scheme, (sdk, extra) in SDKS.items():
        assert said[scheme].startswith(
            f"the {scheme!r} adapter needs an extra: pip install 'consumer-kit[{extra}]' "
            f"(from a clone: pip install -e '.[{extra}]') ("
        ), (scheme, said[scheme])
        assert sdk in said[scheme]  # the missing module is named too
        assert extra in declared  # an extra pip knows
