"""Copy ids no producer can compute (consumer_kit/broker/kit/copy_ids.py)."""

from __future__ import annotations

from consumer_kit.broker.kit.copy_ids import ID_CHARS, keyed_copy_id, random_copy_id
from consumer_kit.codec import marks


def test_a_keyed_copy_id_is_stable_under_one_key_and_changes_with_the_key() -> None:
    first = keyed_copy_id("orders.fifo", "6f1c0b5e", "release")
    assert first == keyed_copy_id("orders.fifo", "6f1c0b5e", "release")
    assert len(first) == ID_CHARS and first != "6f1c0b5e-release"
    assert keyed_copy_id("orders.fifo", "6f1c0b5e", "retry") != first
    previous = marks.installed()
    marks.install(b"k" * 32)
    try:
        assert keyed_copy_id("orders.fifo", "6f1c0b5e", "release") != first
    finally:
        marks.install(previous.current, previous.previous, source=previous.source)


def test_parts_cannot_be_shifted_into_each_other() -> None:
    assert keyed_copy_id("a-b", "c") != keyed_copy_id("a", "b-c")
    assert keyed_copy_id("ab", "c") != keyed_copy_id("a", "bc")


def test_random_copy_ids_are_fresh() -> None:
    ids = {random_copy_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(len(i) == ID_CHARS for i in ids)
