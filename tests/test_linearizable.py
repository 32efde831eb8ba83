"""bench/linearizable.py on small hand-built histories; each expected verdict is reasoned out in its test, not taken
from a run of the checker."""

from __future__ import annotations

import math

from bench.linearizable import EXISTS, INVALID, OK, UNKNOWN, Op, check, linearizable


def op(kind: str, call: float, ret: float, result: object, *args: object, key: str = "k") -> Op:
    return Op(kind, key, tuple(args), call, ret, result)


def test_a_read_after_a_completed_write_must_see_it():
    # The write returned at 1; a read that begins at 2 must come after it, so it cannot find the key absent.
    assert linearizable([op("set", 0, 1, OK, b"1", True), op("get", 2, 3, None)]) is False
    assert linearizable([op("set", 0, 1, OK, b"1", True), op("get", 2, 3, b"1")]) is True


def test_a_read_concurrent_with_a_write_may_see_either():
    # The read overlaps the write: it may take effect before it (absent) or after it (the value).
    assert linearizable([op("set", 0, 2, OK, b"1", True), op("get", 1, 3, None)]) is True
    assert linearizable([op("set", 0, 2, OK, b"1", True), op("get", 1, 3, b"1")]) is True


def test_intervals_that_touch_count_as_concurrent():
    # The read is called at the very moment the write returns: neither is known to precede the other.
    assert linearizable([op("set", 0, 1, OK, b"1", True), op("get", 1, 2, None)]) is True


def test_concurrent_writes_read_in_either_order():
    a, b = op("set", 0, 2, OK, b"a", True), op("set", 0, 2, OK, b"b", True)
    # After both returned, one of them was last: a read may see either, and later reads the same one.
    assert linearizable([a, b, op("get", 3, 4, b"a"), op("get", 5, 6, b"a")]) is True
    assert linearizable([a, b, op("get", 3, 4, b"b"), op("get", 5, 6, b"b")]) is True
    # No write follows the first read, so a later read cannot see the other value.
    assert linearizable([a, b, op("get", 3, 4, b"a"), op("get", 5, 6, b"b")]) is False
    # During the writes, reads may watch a then b (order a, b), and the final read must then see b.
    during = [op("get", 0.5, 1.0, b"a"), op("get", 1.1, 1.5, b"b")]
    assert linearizable([a, b, *during, op("get", 3, 4, b"b")]) is True
    assert linearizable([a, b, *during, op("get", 3, 4, b"a")]) is False


def test_a_lost_increment_is_caught():
    # Two increments from 0 (absent) answer 1 and 2 whatever their order; both answering 1 lost one of them.
    assert linearizable([op("incr", 0, 2, 1, 1), op("incr", 0, 2, 2, 1)]) is True
    assert linearizable([op("incr", 0, 2, 1, 1), op("incr", 0, 2, 1, 1)]) is False
    # The sum is stored as decimal text: a read after both sees b"2", not b"1".
    assert linearizable([op("incr", 0, 1, 1, 1), op("incr", 2, 3, 2, 1), op("get", 4, 5, b"2")]) is True
    assert linearizable([op("incr", 0, 1, 1, 1), op("incr", 2, 3, 2, 1), op("get", 4, 5, b"1")]) is False


def test_an_increment_of_text_that_is_no_integer_is_refused():
    assert linearizable([op("set", 0, 1, OK, b"x", True), op("incr", 2, 3, INVALID, 1)]) is True
    assert linearizable([op("set", 0, 1, OK, b"x", True), op("incr", 2, 3, 1, 1)]) is False


def test_a_write_of_unknown_outcome_may_show_up_later_or_never():
    lost = Op("set", "k", (b"a", True), call=0, ret=math.inf, result=UNKNOWN)
    # Not seen at 1-2, seen at 3-4: it took effect in between.
    assert linearizable([lost, op("get", 1, 2, None), op("get", 3, 4, b"a")]) is True
    # Never seen: it never took effect.
    assert linearizable([lost, op("get", 1, 2, None), op("get", 3, 4, None)]) is True
    # Seen, then gone with nothing that deletes it: it cannot have taken effect twice.
    assert linearizable([lost, op("get", 1, 2, b"a"), op("get", 3, 4, None)]) is False
    # It cannot take effect before it was called.
    assert linearizable([op("get", 0, 1, b"a"), Op("set", "k", (b"a", True), call=2)]) is False


def test_a_set_applied_twice_by_a_retry_is_caught():
    # A's set spans everything (its reply was lost and it was sent again). Reads see a, then B's b, then a again:
    # a single moment for A's set cannot give that, since no write of a follows B's.
    history = [op("set", 0, 10, OK, b"a", True), op("get", 1, 2, b"a"), op("set", 3, 4, OK, b"b", True),
               op("get", 5, 6, b"b"), op("get", 11, 12, b"a")]
    assert linearizable(history) is False


def test_compare_set_answers_what_the_key_holds_afterwards():
    # Empty expected: swap only while absent. The second swap finds x and answers it, changing nothing.
    first, second = op("cas", 0, 1, b"x", b"", b"x"), op("cas", 2, 3, b"x", b"", b"y")
    assert linearizable([first, second, op("get", 4, 5, b"x")]) is True
    assert linearizable([first, op("cas", 2, 3, b"y", b"", b"y")]) is False
    # A matching expected swaps.
    assert linearizable([first, op("cas", 2, 3, b"z", b"x", b"z"), op("get", 4, 5, b"z")]) is True
    # On an absent key with a non-empty expected nothing happens: the answer is None (absent).
    assert linearizable([op("cas", 0, 1, None, b"x", b"y")]) is True


def test_a_set_without_overwrite_is_refused_on_another_value_only():
    assert linearizable([op("set", 0, 1, OK, b"a", False), op("set", 2, 3, EXISTS, b"b", False)]) is True
    assert linearizable([op("set", 0, 1, OK, b"a", False), op("set", 2, 3, OK, b"b", False)]) is False
    # The same value again is no overwrite.
    assert linearizable([op("set", 0, 1, OK, b"a", False), op("set", 2, 3, OK, b"a", False)]) is True


def test_a_delete_counts_what_it_removed():
    written = op("set", 0, 1, OK, b"a", True)
    assert linearizable([written, op("delete", 2, 3, 1), op("get", 4, 5, None)]) is True
    assert linearizable([written, op("delete", 2, 3, 0)]) is False
    assert linearizable([written, op("delete", 2, 3, 1), op("delete", 4, 5, 1)]) is False


def test_keys_are_checked_apart():
    history = [op("set", 0, 1, OK, b"a", True, key="x"), op("get", 2, 3, None, key="y"),
               op("get", 2, 3, None, key="x")]
    assert check(history) == {"x": False, "y": True}


def test_the_search_gives_up_within_its_budget():
    writes = [op("set", 0, 10, OK, str(i).encode(), True) for i in range(12)]
    assert linearizable([*writes, op("get", 11, 12, b"none of them")], budget=100) is None
