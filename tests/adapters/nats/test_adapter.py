"""The NATS adapter's own rules that need no server: the ``nats://`` URL, subjects per partition
key, headers NATS cannot carry, and sizes (the contract suite checks them against a real server)."""

from __future__ import annotations

import pytest

from consumer_kit.adapters.nats import (
    NATSConfig,
    headers_for,
    headers_of,
    stream_name,
    subject_for,
    subject_of,
)
from consumer_kit.adapters.nats.limits import fit, size_of
from consumer_kit.adapters.nats.redelivery import MAX_ENTRIES
from consumer_kit.broker.kit.give_backs import GiveBacks
from consumer_kit.broker.publishing import OutgoingMessage
from consumer_kit.codec import headers as own
from consumer_kit.errors import ConfigurationError


def test_the_url_gives_servers_and_options() -> None:
    config = NATSConfig.from_url("nats://a:4222,b:4223?ack_wait=3&heartbeat=off&ordered=true&max_deliver=60")
    assert config.servers == ("nats://a:4222", "nats://b:4223")
    assert (config.ack_wait, config.heartbeat, config.ordered, config.max_deliver) == (3.0, False, True, 60)
    assert NATSConfig.from_url("nats://127.0.0.1").ack_wait == 30.0


@pytest.mark.parametrize("url", [
    "amqp://x", "nats://", "nats://h?visibility=3", "nats://h?ack_wait=0", "nats://h?ack_wait=soon",
    "nats://h?heartbeat=maybe", "nats://h?fetch_wait=600",
])
def test_a_bad_url_is_refused_clearly(url: str) -> None:
    with pytest.raises(ConfigurationError):
        NATSConfig.from_url(url)


def test_user_info_reaches_the_server_but_never_a_message() -> None:
    config = NATSConfig.from_url("nats://me:secret@h:4222,h2")
    assert config.servers == ("nats://me:secret@h:4222", "nats://me:secret@h2")
    assert "secret" not in config.display
    with pytest.raises(ConfigurationError) as refused:
        NATSConfig.from_url("nats://me:secret@h?nope=1")
    assert "secret" not in str(refused.value)


def test_names_and_subjects_per_partition_key() -> None:
    assert stream_name("invoices.commands") == "invoices_commands"
    assert subject_for("q", None) == "q" and subject_for("q", "c-1") == "q.k.c-1"
    hashed = subject_for("q", "a.b *>")
    assert hashed.startswith("q.k.h") and len(hashed) == len("q.k.h") + 32
    assert subject_of(OutgoingMessage("billing.events", "invoice.created", "e", b"{}", "E", partition_key="c-1")) \
        == "billing.events.invoice.created.k.c-1"
    assert subject_of(OutgoingMessage("", "invoices.commands", "e", b"{}", "E")) == "invoices.commands"
    for bad in ("", "a b", "a.*", "a.>", "a..b"):
        with pytest.raises(ConfigurationError):
            stream_name(bad)


def test_headers_nats_cannot_carry_travel_packed_and_come_back() -> None:
    sent = headers_for({"ok": "1", "bad name": "x", "multi": "a\r\nb", "n": 5})
    assert sent["ok"] == "1" and sent["n"] == "5" and "bad name" not in sent and "multi" not in sent
    assert headers_of(sent) == {"ok": "1", "n": "5", "bad name": "x", "multi": "a\r\nb"}


def test_size_counts_the_header_block_and_a_copy_is_trimmed_to_fit() -> None:
    assert size_of(b"abc", {}) == 3
    assert size_of(b"abc", {"k": "v"}) == len(b"NATS/1.0\r\nk: v\r\n\r\n") + 3
    headers = {own.DEAD_LETTER_REASON: "invalid_json", own.DEAD_LETTER_DETAIL: "d" * 500, "big": "x" * 300}
    sent, dropped = fit(b"{}", headers, 200, droppable=(own.DEAD_LETTER_DETAIL,), extra={"Nats-Msg-Id": "s-1-x"})
    assert size_of(b"{}", sent) <= 200 and sent[own.DEAD_LETTER_REASON] == "invalid_json"
    assert dropped[0] == "big" and own.DEAD_LETTER_DETAIL in dropped
    with pytest.raises(ValueError, match="exceeds the maximum message size of 10 bytes"):
        fit(b"x" * 20, {}, 10)


def test_a_remembered_nak_is_no_redelivery_and_an_unexplained_count_is() -> None:
    backs: GiveBacks[tuple[str, int]] = GiveBacks(MAX_ENTRIES)
    assert backs.judge(("s", 1), 1) == (1, False)
    backs.remember(("s", 1), 1, uncounted=False, suspect=False)
    assert backs.judge(("s", 1), 2) == (2, False)
    assert backs.judge(("s", 1), 3) == (3, True)  # a lapse
    backs.remember(("s", 2), 1, uncounted=True, suspect=False)  # an uncounted give-back
    assert backs.judge(("s", 2), 2) == (1, False)
    assert backs.judge(("s", 2), 3) == (2, True)  # its uncounted hand-out still counts
    assert backs.judge(("s", 9), 2, earlier=3) == (5, True)  # another process's
    backs.forget(("s", 2))  # acked: nothing to explain any more
    assert len(backs) == 0
