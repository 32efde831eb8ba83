"""A runtime's start-up exchange in ifrt's key-value store, scoped to one start of the job.

Before a runtime starts from the topology (``ifrt.jax``, ``ifrt.torch``), every process answers the leader's fresh
start: the leader (process 0; the lowest process id of the topology, should a shrink have dropped process 0)
publishes a nonce (and whatever its runtime needs, e.g. JAX's coordinator address), each process answers under that
nonce with a nonce of its own, and the leader publishes everyone's answer. A process accepts only
a record that carries its own fresh nonce, so a job restarted against a durable journal never reads a previous
start's records. Keys, for runtime R, topology generation G and process 0's nonce N0::

    ifrt/R/gG/start          process 0: {"nonce": N0, **record}, overwritten by every start
    ifrt/R/gG/N0/join/<p>    process p: {"nonce": Np, **answer}
    ifrt/R/gG/N0/ready       process 0: {"nonces": {p: Np}, "answers": {p: answer}, **record}

Every wait has the start's deadline (DiscoveryTimeout naming who did not answer), and a peer that fails meanwhile
ends it at once in every process (BarrierFailed naming it). A coordinator failover ends nothing: each key-value call,
its short reads included, waits for the standby to take over (``Connection.call``'s failover window).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, ClassVar

from ifrt import events, waiting
from ifrt.client import Client
from ifrt.connection import Backoff
from ifrt.errors import BarrierFailed, DiscoveryTimeout, KeyValueTimeout
from ifrt.pushed import PushedKeys
from ifrt.topology import Topology
from ifrt.waiting import Pacer

RECHECK_S = 1.0
"""How often a waiting process reads the records again and checks for failed peers."""
READY_FIRST_S = 0.05
"""The first wait of a follower for a process 0's confirmation, doubling to RECHECK_S: the process 0 it joined may
be one whose start is over (a recovery's new start deletes its keys and then writes its own record), and the new
record is read again only when a wait ends."""
_FIELDS = ("nonces", "answers")


class StartupExchange:
    """One start of a runtime; ``runtime`` names its keys (``ifrt/<runtime>/``) and ``what`` its messages."""

    runtime: ClassVar[str]
    what: ClassVar[str]

    def __init__(self, client: Client, topology: Topology, deadline: float) -> None:
        self.client, self.topology, self.deadline = client, topology, deadline
        self.prefix = f"ifrt/{self.runtime}/g{topology.generation}"
        self.nonce = uuid.uuid4().hex
        self.answers: dict[int, dict[str, Any]] = {}
        """Every process's answer to the start this process took part in, once ``exchange`` returned."""
        self.leader_nonce: str | None = None
        """Process 0's nonce for that start."""
        self._failed: dict[int, str] = {}
        self._pacer = Pacer(client.config.first_report_s, client.config.poll_s)
        client.on_event(self._on_event, since_topology=True)  # a peer that failed since discovery counts too

    @property
    def scope(self) -> str:
        """The prefix of this start's own keys and barriers (generation and process 0's nonce), once ``exchange``
        returned; the next start deletes its keys."""
        return f"{self.prefix}/{self.leader_nonce}"

    def exchange(self, answer: dict[str, Any], record: Callable[[], dict[str, Any]] = dict) -> dict[str, Any]:
        """Takes part in this start with ``answer``; returns process 0's record (``record()``, called in process 0
        only) once every process has answered."""
        if self.topology.process_id == self.leader:
            return self._lead(answer, record())
        return self._follow(answer)

    @property
    def leader(self) -> int:
        """The process that leads this start: the lowest process id of the topology (0 unless a shrink dropped it)."""
        return self.topology.processes[0].process_id

    @property
    def followers(self) -> list[int]:
        """Every other process of the topology, by id."""
        return [p.process_id for p in self.topology.processes[1:]]

    def check_failures(self) -> None:
        """BarrierFailed naming the lowest failed process of the topology, if one failed since the start began."""
        ids = {p.process_id for p in self.topology.processes}
        failed = {p: why for p, why in dict(self._failed).items() if p in ids}  # the session thread adds to it
        if failed:
            p, why = min(failed.items())
            raise BarrierFailed(f"{self.what} cannot complete: process {p} ({self.host(p)}) {why}")

    def host(self, process_id: int) -> str:
        """Where ``process_id`` runs, for messages: its hostname and transfer address."""
        process = self.topology.process(process_id)
        return f"{process.hostname} {process.address}".strip()

    def _lead(self, answer: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
        view = self._view_of_joins()
        try:
            self._publish_start(record)
            joins = self._joins(view)
        finally:
            if view is not None:
                view.close()
        answers, nonces = {self.leader: answer}, {self.leader: self.nonce}
        for p, joined in joins.items():
            nonces[p] = joined.pop("nonce")
            answers[p] = joined
        self._set(f"{self.prefix}/{self.nonce}/ready", {**record, "nonces": {str(p): n for p, n in nonces.items()},
                                                        "answers": {str(p): a for p, a in answers.items()}})
        self.answers, self.leader_nonce = answers, self.nonce
        return record

    def _publish_start(self, record: dict[str, Any]) -> None:
        """Writes this start's record: in one call where the generation has none yet (its first start); else
        deletes the earlier start's keys (nobody reads them again) and overwrites its record."""
        start = {**record, "nonce": self.nonce}
        held = self.client.kv_compare_set(f"{self.prefix}/start", b"", dump(start), timeout=max(1.0, self._remaining()))
        if held != dump(start):
            if held is not None:
                self.client.kv_delete(f"{self.prefix}/{json.loads(held)['nonce']}/", prefix=True)
            self._set(f"{self.prefix}/start", start)

    def _view_of_joins(self) -> PushedKeys | None:
        """The answers to this start as the coordinator will push them (asked for before the start's record is
        written, so that they come while process 0 writes it); None without a live session."""
        try:
            return PushedKeys(self.client, f"{self.prefix}/{self.nonce}/join/")
        except RuntimeError:
            return None

    def _joins(self, view: PushedKeys | None) -> dict[int, dict[str, Any]]:
        """Every other process's answer to this start: as pushed to ``view`` while it lasts; else those already
        there read in one call, then a wait for the first one missing, and so on (a failed peer or the deadline ends
        it, as every wait)."""
        key = f"{self.prefix}/{self.nonce}/join/{{}}".format
        joins: dict[int, dict[str, Any]] = {}
        pending = self.followers
        while pending:
            if view is not None and view.ready():
                self.check_failures()
                found = view.values([key(p) for p in pending])
                joins.update({p: json.loads(v) for p, v in zip(pending, found, strict=True) if v is not None})
                pending = [p for p in pending if p not in joins]
                if pending and not view.wait([key(p) for p in pending], min(RECHECK_S, max(0.0, self._remaining()))):
                    self._check_deadline(self._missing_joins)
                continue
            if len(pending) > 1:
                self.check_failures()
                found = self.client.kv_multi_get([key(p) for p in pending], timeout=max(1.0, self._remaining()))
                joins.update({p: json.loads(v) for p, v in zip(pending, found, strict=True) if v is not None})
                pending = [p for p in pending if p not in joins]
                if not pending:
                    break
            joins[pending[0]] = self._wait(key(pending[0]), self._missing_joins)
            pending.pop(0)
        return joins

    def _follow(self, answer: dict[str, Any]) -> dict[str, Any]:
        me = str(self.topology.process_id)
        stale: set[str] = set()  # process 0 nonces of earlier starts, whose records are still in the store
        pause = Backoff(0.01, 0.2)
        joined: dict[str, Backoff] = {}  # process 0 nonces answered, each with its waits for the confirmation

        def no_start() -> str:
            return f"process {self.leader} has not begun this start-up" + (
                " (the store holds only a previous start's record)" if stale else "")

        while True:
            leader = self._wait(f"{self.prefix}/start", no_start)["nonce"]
            if leader in stale:  # the leader of this start has not overwritten the record yet
                self._check_deadline(no_start)
                time.sleep(min(pause.next(), max(0.0, self._remaining())))
                continue
            if leader not in joined:
                self._set(f"{self.prefix}/{leader}/join/{me}", {**answer, "nonce": self.nonce})
                joined[leader] = Backoff(READY_FIRST_S, RECHECK_S)
            try:
                ready = self._get(f"{self.prefix}/{leader}/ready", min(joined[leader].next(), self._remaining()))
            except KeyValueTimeout:
                self._check_deadline(lambda leader=leader: f"process {self.leader} did not confirm the start-up: "
                                     f"{self._missing_joins(leader)}")
                continue  # the leader may have been restarted meanwhile: read its record again
            if ready["nonces"].get(me) != self.nonce:
                stale.add(leader)
                continue
            self.answers, self.leader_nonce = {int(p): a for p, a in ready["answers"].items()}, leader
            return {k: v for k, v in ready.items() if k not in _FIELDS}

    def _set(self, key: str, value: dict[str, Any]) -> None:
        self.client.kv_set(key, dump(value), allow_overwrite=True, timeout=max(1.0, self._remaining()))

    def _wait(self, key: str, what_is_missing: Callable[[], str]) -> dict[str, Any]:
        """The record at ``key``, checking for failed peers every RECHECK_S; DiscoveryTimeout at the deadline."""
        while True:
            try:
                return self._get(key, min(RECHECK_S, self._remaining()))
            except KeyValueTimeout:
                self._check_deadline(what_is_missing)

    def _get(self, key: str, timeout: float) -> dict[str, Any]:
        self.check_failures()
        if timeout <= 0:
            raise KeyValueTimeout(f"key {key!r}: no time left")
        return json.loads(self.client.kv_get(key, timeout=timeout))

    def _check_deadline(self, what_is_missing: Callable[[], str]) -> None:
        """Raises what ended the wait (a failed peer, the deadline); says every few seconds what it waits for."""
        self.check_failures()
        if self._remaining() <= 0:
            raise DiscoveryTimeout(f"{self.what} of process {self.topology.process_id} timed out: "
                                   f"{what_is_missing()} (topology generation {self.topology.generation})")
        if self._pacer.due():
            waited = self._pacer.waited()
            waiting.say(logging.WARNING if waited >= self.client.config.warn_after_s else logging.INFO,
                        "%s of process %d waiting (%.0fs so far, %.0fs left): %s", self.what,
                        self.topology.process_id, waited, self._remaining(), what_is_missing())

    def _missing_joins(self, leader: str | None = None) -> str:
        joined = {int(k.rsplit("/", 1)[1]) for k in self.client.kv_dir(f"{self.prefix}/{leader or self.nonce}/join/")}
        missing = sorted(set(self.followers) - joined)
        if not missing:
            return "every process answered"
        return "processes did not answer: " + ", ".join(f"{p} ({self.host(p)})" for p in missing)

    def _on_event(self, event: events.Event) -> None:
        if isinstance(event, events.ProcessFailed):
            self._failed[event.process_id] = f"failed: {event.reason}"
        elif isinstance(event, events.ProcessRestarted):
            self._failed.pop(event.process_id, None)

    def _remaining(self) -> float:
        return self.deadline - time.monotonic()


def dump(value: Any) -> bytes:
    """A record's bytes: canonical JSON, so equal records are equal bytes."""
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
