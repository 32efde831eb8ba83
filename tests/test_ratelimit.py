"""Repeated warnings cost one line per kind and interval plus a count, whatever a caller sends."""

from __future__ import annotations

import logging

import pytest

from ifrt.ratelimit import MAX_KINDS, Throttled


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def throttled(caplog) -> tuple[Throttled, Clock]:
    caplog.set_level(logging.INFO, logger="test.ratelimit")
    clock = Clock()
    return Throttled(logging.getLogger("test.ratelimit"), interval=10.0, clock=clock), clock


def test_the_first_of_a_kind_is_written_and_the_rest_of_the_interval_counted(throttled, caplog):
    noisy, _ = throttled
    assert noisy.warning("bad", "bad message from %s", "a")
    assert not any(noisy.warning("bad", "bad message from %s", f"b{i}") for i in range(999))
    assert [r.getMessage() for r in caplog.records] == ["bad message from a"]
    assert noisy.held_back("bad") == 999


def test_the_next_line_after_the_interval_says_how_many_were_held_back(throttled, caplog):
    noisy, clock = throttled
    for _ in range(5):
        noisy.warning("bad", "bad message")
    clock.now += 10.0
    assert noisy.warning("bad", "bad message")
    assert caplog.records[-1].getMessage() == "bad message (4 more like this in the last 10s)"
    assert noisy.held_back("bad") == 0


def test_kinds_are_counted_apart(throttled, caplog):
    noisy, _ = throttled
    noisy.warning("bad", "bad message")
    noisy.warning("refused", "refused call")
    noisy.warning("bad", "bad message")
    assert [r.getMessage() for r in caplog.records] == ["bad message", "refused call"]


def test_flush_writes_the_counts_and_resets_them(throttled, caplog):
    noisy, _ = throttled
    for _ in range(3):
        noisy.warning("bad", "bad message")
    noisy.warning("quiet", "once")
    noisy.flush()
    assert caplog.records[-1].getMessage() == "2 more bad records held back in the last 10s"
    assert caplog.records[-1].levelno == logging.WARNING
    noisy.flush()
    assert len(caplog.records) == 3  # nothing new held back, nothing written


def test_the_kinds_remembered_are_bounded(throttled):
    noisy, _ = throttled
    for i in range(MAX_KINDS * 4):
        noisy.warning(f"kind-{i}", "message")
    assert len(noisy._kinds) == MAX_KINDS
