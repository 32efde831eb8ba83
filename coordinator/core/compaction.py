"""Journal compaction: which entries a replay still needs, decided without I/O.

A key's value needs only its latest write. An increment or swap that a retry may still ask about (a call
``coordinator.core.retries`` still remembers, within ``--max-answer-bytes``) keeps its entry for the answer, even when a
later write replaced its value; a deletion stays only while it removes such a kept write; of a caller's records of
the answers it forgot (``journal.AnswersForgotten``), the newest stays, so that the retries of the calls dropped stay
refused. A finished barrier that a later barrier of its series forgot (``supersedes``) goes, with the record of a
second participant arriving at it. Everything else (registrations, failures, departures, barriers, live-set
agreements, preemption) stays, within the current job attempt; of the attempts that ended, key-values, barriers
and agreements go (a new attempt starts them empty), and so do those of the ended runs of the current attempt
(``coordinator.core.runs``), but the agents' keys, which a new run keeps. Replaying the kept entries, in their order,
builds the same state as replaying them all, and so does a journal of which only an oldest part was compacted (a
store that cannot replace its journal at once applies the result oldest first, in steps).

    set k=A   set k=B   incr n (call r1)   del k   incr n (call r2)        ->   incr n (r1)   incr n (r2)
    dropped   dropped   kept: r1's answer  dropped kept: n's value
"""

from __future__ import annotations

from collections.abc import Sequence

from coordinator.core import journal
from coordinator.core.kv import AGENT_KEY_PREFIX
from coordinator.core.limits import DEFAULT_LIMITS, Limits
from coordinator.core.retries import Answer, Deleted, RetryAnswers, Stored

MIN_BYTES = 32 << 20
"""Superseded journal bytes below which no compaction runs (the journal is then small anyway)."""
MIN_ENTRIES = 10_000
"""Superseded entries below which no compaction runs."""

_WRITES = (journal.KeySet, journal.KeyIncremented, journal.KeySwapped)
_BARRIERS = (journal.BarrierFinished, journal.BarrierJoined)
_STANDALONE = (*_WRITES, journal.KeysDeleted, *_BARRIERS, journal.LiveSetDecided, journal.AnswersForgotten)
"""Entries that name no registration, so an ended attempt's are dropped: the next attempt starts without them, and a
replay of a journal compacted only in part needs none of them to apply what follows (a failure or a departure
needs the registration it names, so those stay)."""


def needed(entries: Sequence[journal.Entry], limits: Limits = DEFAULT_LIMITS) -> list[bool]:
    """For each entry, whether a replay still needs it (see the module's docstring), under the ``limits`` the
    coordinator remembers answers by."""
    start = _current_attempt_start(entries)
    run = _current_run_start(entries, start)
    carried = {start + i for i in _final_writes(entries[start:]) if entries[start + i].key.startswith(AGENT_KEY_PREFIX)}
    forgotten = _forgotten_barriers(entries)
    return ([not isinstance(e, _STANDALONE) for e in entries[:start]]
            + [not isinstance(e, _STANDALONE) or i in carried for i, e in enumerate(entries[start:run], start)]
            + [k and i not in forgotten for i, k in enumerate(_needed_in_attempt(entries[run:], limits), run)])


def _forgotten_barriers(entries: Sequence[journal.Entry]) -> set[int]:
    """Indices of the finished barriers that a later barrier of their series forgot (``supersedes``), and of the
    second arrivals at them: a replay forgets them anyway (forgetting one it never saw changes nothing). A name used
    again after it was forgotten keeps its new entries."""
    forgotten: set[int] = set()
    later: set[str] = set()  # names some later entry forgot
    for i in range(len(entries) - 1, -1, -1):
        entry = entries[i]
        if isinstance(entry, _BARRIERS):
            if entry.name in later:
                forgotten.add(i)
            if isinstance(entry, journal.BarrierFinished) and entry.forgot:
                later.add(entry.forgot)
    return forgotten


def _current_run_start(entries: Sequence[journal.Entry], start: int) -> int:
    """Where the current run of the job begins within the attempt that begins at ``start`` (coordinator.core.runs): the
    ended runs' standalone entries go, but the final writes of the agents' keys, which a new run keeps."""
    for i in range(len(entries) - 1, start - 1, -1):
        if isinstance(entries[i], journal.RunStarted):
            return i + 1
    return start


def _current_attempt_start(entries: Sequence[journal.Entry]) -> int:
    """Where the current job attempt's entries begin: after the decision that started it (0: the first attempt)."""
    for i in range(len(entries) - 1, -1, -1):
        entry = entries[i]
        if isinstance(entry, journal.AttemptDecided) and not entry.exhausted and not entry.replace:
            return i + 1  # (a replacement goes on in the same attempt)
    return 0


def _needed_in_attempt(entries: Sequence[journal.Entry], limits: Limits) -> list[bool]:
    """``needed`` within one attempt's entries."""
    keep = [True] * len(entries)
    final = _final_writes(entries)
    answers = _remembered_answers(entries, limits)
    records = {e.client_uid: i for i, e in enumerate(entries) if isinstance(e, journal.AnswersForgotten)}
    pending: set[str] = set()  # keys of kept writes that are not their key's final value
    for i, entry in enumerate(entries):
        if isinstance(entry, journal.AnswersForgotten):
            keep[i] = records[entry.client_uid] == i  # a record only grows: its newest says it all
        if isinstance(entry, _WRITES):
            if i in final:
                pending.discard(entry.key)
            elif i in answers:
                pending.add(entry.key)
            else:
                keep[i] = False
        elif isinstance(entry, journal.KeysDeleted):
            covered = ({k for k in pending if k.startswith(entry.key)} if entry.prefix
                       else {entry.key} & pending)
            keep[i] = bool(covered) or i in answers  # a deletion a retry may still ask about keeps its count
            pending -= covered
    return keep


def _final_writes(entries: Sequence[journal.Entry]) -> set[int]:
    """Indices of the writes no later write or deletion supersedes."""
    final: set[int] = set()
    written: set[str] = set()
    deleted: set[str] = set()
    prefixes: set[str] = set()
    lengths: set[int] = set()
    for i in range(len(entries) - 1, -1, -1):
        entry = entries[i]
        if isinstance(entry, _WRITES):
            key = entry.key
            if key in written or key in deleted or any(key[:n] in prefixes for n in lengths):
                continue
            written.add(key)
            final.add(i)
        elif isinstance(entry, journal.KeysDeleted):
            if entry.prefix:
                prefixes.add(entry.key)
                lengths.add(len(entry.key))
            else:
                deleted.add(entry.key)
    return final


def _remembered_answers(entries: Sequence[journal.Entry], limits: Limits) -> set[int]:
    """Indices of the writes and deletions whose calls a replay remembers at the end, found by remembering them as
    the state machine does (``coordinator.core.retries``), and of the newest call forgotten for want of bytes: replayed
    before the remembered ones, it leaves no room for any older call a kept write would bring back. (The callers'
    records, which count too, come back whole from their newest entries.)"""
    retries = RetryAnswers(limits)
    last: dict[tuple[str, str, str], int] = {}  # call -> the entry that last set its answer
    for i, entry in enumerate(entries):
        if isinstance(entry, journal.AnswersForgotten):  # (a journal compacted before holds them, not the calls)
            retries.forgot(entry.client_uid, entry.through, entry.unordered)
        elif isinstance(entry, _REMEMBERED) and entry.request_id:
            answer, stored = _answer(entry)
            retries.remember(entry.client_uid, entry.request_id, entry.key, answer, stored)
            last[(entry.client_uid, entry.request_id, entry.key)] = i
    remembered = {last.pop(call) for call in retries.calls()}
    return remembered | ({max(last.values())} if last and remembered else set())


_REMEMBERED = (*_WRITES, journal.KeysDeleted)


def _answer(entry: journal.KeySet | journal.KeyIncremented | journal.KeySwapped | journal.KeysDeleted) -> tuple[Answer,
                                                                                                                int]:
    """The answer a replay remembers for ``entry``'s call, and the bytes its entry keeps (as KeyValues does)."""
    match entry:
        case journal.KeyIncremented(value=value):
            return value, 0
        case journal.KeySwapped(value=value) | journal.KeySet(value=value):
            return Stored.of(value), len(value)
        case journal.KeysDeleted(count=count):
            return Deleted(count), 0
    raise AssertionError(f"not a remembered call: {entry!r}")


class Garbage:
    """How much of the journal a compaction would drop, estimated as entries are journaled: a write that a later
    write or deletion supersedes, every deletion, and a barrier its series forgot. ``due()`` says when compacting
    pays."""

    def __init__(self) -> None:
        self._latest: dict[str, int] = {}  # key -> bytes of its latest write
        self._barriers: dict[str, tuple[int, int]] = {}
        """Finished barrier -> bytes and count of its entries (its early cancels' and second arrival's too), until its
        series forgets it."""
        self._records: dict[str, int] = {}  # caller -> bytes of its newest record of forgotten answers
        self.bytes = self.entries = 0  # superseded, since this estimate started
        self.total_bytes = self.total_entries = 0
        self._floor_bytes, self._floor_entries = MIN_BYTES, MIN_ENTRIES

    @classmethod
    def of(cls, entries: Sequence[journal.Entry], sizes: Sequence[int], *, compacted: bool) -> Garbage:
        """The estimate for a journal of ``entries`` (``sizes`` bytes each). Just ``compacted``, the next compaction
        waits for as much new garbage as the journal now holds (at least the minimums); otherwise (a journal found
        on taking over) it is due as soon as the garbage reaches the minimums."""
        garbage = cls()
        for entry, size in zip(entries, sizes, strict=True):
            garbage.observe(entry, size)
        if compacted:
            garbage._floor_bytes = garbage.bytes + max(MIN_BYTES, garbage.total_bytes)
            garbage._floor_entries = garbage.entries + max(MIN_ENTRIES, garbage.total_entries)
        return garbage

    def observe(self, entry: journal.Entry, size: int) -> None:
        """Counts one entry journaled after the others (``size`` bytes encoded)."""
        self.total_bytes += size
        self.total_entries += 1
        if isinstance(entry, _WRITES):
            if (old := self._latest.get(entry.key)) is not None:
                self.bytes += old
                self.entries += 1
            self._latest[entry.key] = size
        elif isinstance(entry, journal.KeysDeleted):
            gone = ([k for k in self._latest if k.startswith(entry.key)] if entry.prefix
                    else [entry.key] * (entry.key in self._latest))
            self.bytes += size + sum(self._latest.pop(k) for k in gone)
            self.entries += 1 + len(gone)
        elif isinstance(entry, _BARRIERS):  # a barrier its series' next one forgot
            held, count = self._barriers.get(entry.name, (0, 0))
            self._barriers[entry.name] = (held + size, count + 1)
            forgot = entry.forgot if isinstance(entry, journal.BarrierFinished) else ""
            if forgot and (old := self._barriers.pop(forgot, None)) is not None:
                self.bytes += old[0]
                self.entries += old[1]
        elif isinstance(entry, journal.AnswersForgotten):  # a caller's newer record supersedes its older one
            if (old := self._records.get(entry.client_uid)) is not None:
                self.bytes += old
                self.entries += 1
            self._records[entry.client_uid] = size
        elif isinstance(entry, journal.RunStarted):  # the ended run's keys go, but the agents'; its records too
            gone = [k for k in self._latest if not k.startswith(AGENT_KEY_PREFIX)]
            self.bytes += sum(self._latest.pop(k) for k in gone) + sum(self._records.values())
            self.entries += len(gone) + len(self._records)
            self._records.clear()

    def due(self) -> bool:
        """Whether a compaction would now drop at least as much as the journal held after the last one."""
        return self.bytes >= self._floor_bytes or self.entries >= self._floor_entries
