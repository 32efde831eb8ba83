"""Whether a history of live-set answers (JAX's ``live_devices``, ifrt's ``live_processes``) keeps the semantics JAX's
"Fault Tolerant Distributed JAX" (Part 3) defines for them: a call that returns the set A, of processes with their
incarnations, must have had a moment, between its call and its return, at which every member of A was inside a
call of its own (one that returned A too, or never returned) and every other process was dead. A failure may be
moved earlier or later in time, but not past another event of the same process: an incarnation can be taken for
dead from its last event on (the return of its last call, or the start of the call it died in) and, where it was
never seen to die, never.

A history is one record per incarnation (``Life``); times are seconds on one clock shared by every process
(``time.monotonic()`` on one machine). Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

Answer = tuple[tuple[int, int], ...]
"""A live set: (process id, incarnation) pairs, sorted."""


@dataclass(frozen=True)
class Call:
    """One live-set call: when it began, when it returned (infinity: it never did) and what (None: nothing)."""

    start: float
    end: float = math.inf
    answer: Answer | None = None


@dataclass(frozen=True)
class Life:
    """One incarnation of a process: when it was born (registered), its calls in order, and whether it died (was
    killed) or lives on past the history's end (a process that ended on purpose died at its last event too)."""

    process: int
    incarnation: int
    born: float
    calls: tuple[Call, ...] = ()
    died: bool = False

    @property
    def last_event(self) -> float:
        """The earliest moment this incarnation can be taken for dead (infinity if it never died)."""
        if not self.died:
            return math.inf
        return max([self.born, *(c.end if c.end != math.inf else c.start for c in self.calls)])


@dataclass
class Verdict:
    """The calls checked, and one line for each answer no moment explains."""

    checked: int = 0
    violations: list[str] = field(default_factory=list)


def check(lives: Iterable[Life]) -> Verdict:
    """Every returned answer of ``lives``, checked against the others (see the module docstring).

    Each dead incarnation gets one moment of death, the earliest that every answer allows: at least its last event,
    and at least the earliest moment of each answer that has it as a member. Those moments only grow, each answer's
    earliest moment with them; once none grows, an answer with no moment left is a violation."""
    lives = list(lives)
    answered = [(life, call) for life in lives for call in life.calls
                if call.answer is not None and call.end != math.inf]
    death = {(life.process, life.incarnation): life.last_event for life in lives}
    while True:
        earliest = {id(call): next((t for t in _moments(lives, call) if _explains(lives, call.answer, t, death)), None)
                    for _, call in answered}
        grown = dict(death)
        for _, call in answered:
            t = earliest[id(call)]
            for member in call.answer or ():
                if t is not None and member in grown and grown[member] != math.inf:
                    grown[member] = max(grown[member], t)
        if grown == death:
            break
        death = grown
    verdict = Verdict(checked=len(answered))
    for life, call in answered:
        if earliest[id(call)] is None:
            verdict.violations.append(
                f"process {life.process} incarnation {life.incarnation}: the answer {list(call.answer or ())} of its "
                f"call [{call.start:.3f}, {call.end:.3f}] has no moment at which exactly those were in a call and "
                "every other process could be dead")
    return verdict


def _moments(lives: Sequence[Life], call: Call) -> list[float]:
    """The moments within ``call`` worth trying: its ends and every other event inside it (the conditions change only
    there)."""
    points = {call.start, call.end}
    for life in lives:
        for t in (life.born, life.last_event, *(x for c in life.calls for x in (c.start, c.end))):
            if call.start <= t <= call.end:
                points.add(t)
    return sorted(points)


def _explains(lives: Sequence[Life], answer: Answer | None, t: float,
              death: Mapping[tuple[int, int], float]) -> bool:
    members: Mapping[int, int] = dict(answer or ())
    for life in lives:
        if members.get(life.process) == life.incarnation:
            if not any(c.start <= t <= c.end and c.answer in (answer, None) for c in life.calls):
                return False  # a member was not in a call that this answer could have ended
        elif life.born <= t < death[(life.process, life.incarnation)]:
            return False  # another incarnation alive at t, outside the set
    return True
