"""bench/live_sets.py on the executions JAX's "Fault Tolerant Distributed JAX" (Part 3) draws, each verdict as that
text reasons it out (a failure may move in time, never past another event of its process)."""

from __future__ import annotations

import math

from bench.live_sets import Call, Life, check

INF = math.inf


def test_a_member_that_died_in_its_call_after_the_service_counted_it():
    # Process 1 called, then died; process 0, born later, got {0, 1}: the death is moved to after process 0's call.
    history = [Life(1, 0, 25, (Call(50),), died=True), Life(0, 0, 175, (Call(200, 250, ((0, 0), (1, 0))),))]
    assert check(history).violations == []


def test_a_live_process_partitioned_away_may_be_taken_for_dead():
    # Process 1 was in its call throughout, but its death can be moved back to the call's start.
    history = [Life(0, 0, 25, (Call(100, 200, ((0, 0),)),)), Life(1, 0, 25, (Call(50),), died=True)]
    assert check(history).violations == []


def test_a_process_restarted_before_the_call_cannot_be_counted_with_its_old_incarnation():
    history = [Life(1, 0, 25, (Call(50),), died=True), Life(1, 1, 175),
               Life(0, 0, 175, (Call(200, 250, ((0, 0), (1, 0))),))]
    verdict = check(history)
    assert verdict.checked == 1 and len(verdict.violations) == 1
    assert "process 0 incarnation 0: the answer [(0, 0), (1, 0)]" in verdict.violations[0]


def test_deaths_moved_to_explain_two_answers_at_once():
    history = [
        Life(0, 0, 25, (Call(40, 150, ((0, 0),)), Call(175, 275, ((0, 0), (2, 0))))),
        Life(1, 0, 50, (Call(65),), died=True),
        Life(1, 1, 150, (Call(165),), died=True),
        Life(2, 0, 100, (Call(115),), died=True),
    ]
    verdict = check(history)
    assert verdict.checked == 2 and verdict.violations == []


def test_one_death_cannot_come_both_before_and_after():
    # {1} needs process 2 dead before 125; {0, 2} needs it alive in its call after 180: no one moment of death.
    history = [Life(0, 0, 165, (Call(180, 275, ((0, 0), (2, 0))),)),
               Life(1, 0, 25, (Call(40, 125, ((1, 0),)),), died=True),
               Life(2, 0, 25, (Call(40),), died=True)]
    verdict = check(history)
    assert len(verdict.violations) == 1 and "process 1 incarnation 0: the answer [(1, 0)]" in verdict.violations[0]


def test_a_caller_missing_from_its_own_answer_or_a_live_process_left_out():
    assert check([Life(0, 0, 0, (Call(1, 2, ((1, 0),)),)), Life(1, 0, 0, (Call(1, 2, ((1, 0),)),))]).violations
    assert check([Life(0, 0, 0, (Call(1, 2, ((0, 0),)),)), Life(1, 0, 0)]).violations  # 1 lives on, never called
