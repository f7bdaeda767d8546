"""The give-back book every adapter keeps to tell a crash from its own give-back
(:mod:`consumer_kit.broker.kit.give_backs`); each adapter's own counts are tested in its module. No broker needed."""

from __future__ import annotations

import pytest

from consumer_kit.broker.kit.give_backs import GiveBacks


def test_only_the_count_a_give_back_expects_clears_a_redelivery() -> None:
    book: GiveBacks[str] = GiveBacks(10)
    assert book.judge("m", 1) == (1, False)  # a first hand-out
    assert book.judge("m", 2) == (2, True)  # nothing remembered: a crash, maybe
    book.remember("m", 2, suspect=False)
    assert book.judge("m", 4) == (4, True)  # a lock lapsed after our give-back
    book.remember("m", 4, suspect=True)
    assert book.judge("m", 5) == (5, True)  # a suspect stays a suspect
    book.remember("m", 5, suspect=False)
    assert book.judge("m", 6) == (6, False) and len(book) == 0  # used up: nothing left to explain
    assert book.judge("m", 7) == (7, True)
    assert book.judge("copy", 1, earlier=3, copied_suspect=True) == (4, True)


def test_uncounted_give_backs_stay_subtracted_on_later_hand_outs() -> None:
    book: GiveBacks[str] = GiveBacks(10)
    book.remember("m", 1, suspect=False, uncounted=True)
    assert book.judge("m", 2) == (1, False)
    earlier = book.remember("m", 2, suspect=False, uncounted=True)
    assert book.judge("m", 3) == (1, False)
    assert book.judge("m", 4) == (2, True)  # not explained, still two uncounted
    book.remember("m", 4, suspect=False)
    book.forget("m", earlier)  # that give-back failed: back to what was known before it
    assert book.judge("m", 5) == (4, True)
    book.forget("m")
    assert len(book) == 0


def test_what_is_remembered_is_bounded_and_a_dropped_entry_makes_a_false_suspect() -> None:
    book: GiveBacks[int] = GiveBacks(2)
    for key in (1, 2, 3):
        book.remember(key, 1, suspect=False)
    assert len(book) == 2
    assert book.judge(1, 2) == (2, True)  # the oldest was dropped: a false suspect, never a miss
    assert book.judge(3, 2) == (2, False)
    stale: GiveBacks[int] = GiveBacks(2, keep_for=-1.0)  # every entry older than believed
    stale.remember(1, 1, suspect=False, uncounted=True)
    assert stale.judge(1, 2) == (2, True) and len(stale) == 0
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        GiveBacks(0)
