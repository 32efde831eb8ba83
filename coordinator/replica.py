"""One coordinator replica's life: win leadership, rebuild the state from the journal, serve, and step down
when the store is lost, then start over. Writes reach the store in the order the state machine made them.

    standby ──(acquire)──▶ replaying ──(journal replayed)──▶ serving ──(store lost / append failed)──▶ standby

Durability before visibility: ``commit()`` returns only once every journal entry made so far, by any call,
is durable. Every answer (a topology, a key-value, a barrier result, an event) is sent after a ``commit()``,
so nothing a process holds can be missing from the journal the next leader replays. ``serving`` and ``commit()``
also ask the store whether its lease still holds, margin included (``Store.holds_lease``, one clock read): nothing
is answered from a state this replica may no longer lead.

One writer, one store write in flight: each write carries every entry queued meanwhile (group commit), and
while many calls wait, writes are spaced out so that a burst costs a few large store transactions.

The journal holds what replay needs, not every write ever made: once superseded entries (overwritten or
deleted keys) outweigh the rest, the writer compacts it between two writes (``coordinator.core.compaction``), and a
replica that finds such a journal on taking over compacts it before serving.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable

from coordinator.config import CoordinatorConfig
from coordinator.core import compaction, journal
from coordinator.core.cluster import ClusterConfig
from coordinator.core.durable import difference
from coordinator.core.state import ClusterState
from coordinator.store import Store, StoreError
from ifrt import wire

log = logging.getLogger("ifrt.coordinator")


class NotServing(RuntimeError):
    """This replica cannot answer now (a standby, or it lost its store); clients should try another."""


async def _no_report(serving: bool) -> None:
    return None


def _ignore(seconds: float) -> None:
    return None


class Replica:
    """Holds the current ``state`` while this replica leads; ``epoch`` changes whenever the state is rebuilt."""

    def __init__(self, config: ClusterConfig, store: Store, advertise: str, clock: Callable[[], float],
                 on_serving: Callable[[], None], on_step_down: Callable[[str], None],
                 report: Callable[[bool], Awaitable[None]] = _no_report,
                 tunables: CoordinatorConfig | None = None) -> None:
        self.config = config
        self._tunables = tunables or CoordinatorConfig(cluster=config)  # the writer's spacing under load
        self.store = store
        self.state = ClusterState(config)
        self.epoch = 0
        self._serving = False  # led and replayed; ``serving`` adds that the lease still holds
        self.reason = f"this replica stands by ({store.description})"
        self._advertise = advertise
        self._clock = clock
        self._on_serving = on_serving
        self._on_step_down = on_step_down
        self._report = report
        self._pending: list[bytes] = []  # encoded entries not yet handed to the store
        self._garbage = compaction.Garbage()  # how much of the journal a compaction would drop
        self._enqueued = 0  # entries of this epoch handed to the writer, in order
        self._durable = 0  # of those, how many the store has made durable
        self._waiters: list[asyncio.Future] = []  # commit() calls waiting until nothing queued is undurable
        self._wake = asyncio.Event()
        self._down = asyncio.Event()
        self._aside_until = -math.inf  # until when this replica stands aside after suspecting itself (step_aside)
        self._stepped_down = False  # since it last served: a second step-down does nothing more
        self._led_in = -1  # the epoch in which this replica last rebuilt its state to lead
        self.on_append: Callable[[float], None] = _ignore
        """Called with the seconds each successful store append took (metrics)."""

    @property
    def serving(self) -> bool:
        """Whether this replica may answer: it leads, has replayed its journal, and its lease cannot have expired at
        etcd yet, margin included (``Store.holds_lease``: one clock read), so a deposed leader answers nothing."""
        return self._serving and self.store.holds_lease()

    @serving.setter
    def serving(self, value: bool) -> None:
        self._serving = value

    def check(self) -> None:
        """Raises NotServing (saying why) unless this replica leads, has replayed its journal and holds its lease."""
        if not self.serving:
            raise NotServing(self.not_serving_reason())

    def not_serving_reason(self) -> str:
        """Why this replica does not answer, naming the leader when it is known."""
        if self._serving and not self.store.holds_lease():
            return (f"this coordinator's leader lease may expire at etcd any moment (not renewed in time; "
                    f"{self.store.description}): it answers nothing from memory and steps down; another replica "
                    f"may lead")
        leader, attempt = self.store.leader, self.store.leader_attempt
        if leader and leader != self._advertise and attempt is not None:
            return (f"{self.reason}; the coordinator at {leader} still leads attempt {attempt} of the job: this "
                    f"coordinator serves a later attempt once attempt {attempt}'s coordinators are stopped")
        if leader and leader != self._advertise:
            return f"{self.reason}; the coordinator at {leader} leads"
        return self.reason

    async def run(self) -> None:
        """Leads whenever it can, until cancelled."""
        writer = asyncio.create_task(self._write())
        try:
            while True:
                if (aside := self._aside_until - self._clock()) > 0:  # stood aside: a replica the job reaches leads
                    await asyncio.sleep(aside)
                await self.store.acquire(self._advertise)
                try:
                    await self._rebuild()
                except StoreError as e:
                    await self._step_down(f"cannot read the journal: {e}")
                    await asyncio.sleep(0.5)
                    continue
                waits = [asyncio.create_task(self.store.lost.wait()), asyncio.create_task(self._down.wait())]
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for task in waits:
                    task.cancel()
                await self._step_down("leadership lost")
        finally:
            writer.cancel()

    async def commit(self) -> None:
        """Returns once every journal entry the state machine has made so far (by this call or any other) is
        durable. NotServing if the store failed meanwhile: the state that made them is then discarded, so
        nothing unpersisted is ever answered from; NotServing too once the lease may have expired (checked last: an
        answer built right after it comes from a state this replica still led)."""
        epoch = self.epoch
        while True:
            if epoch != self.epoch:
                raise NotServing(self.not_serving_reason())
            entries = self.state.take_journal()
            if entries:
                for entry in entries:
                    encoded = journal.encode(entry)
                    self._pending.append(encoded)
                    self._garbage.observe(entry, len(encoded))
                self._enqueued += len(entries)
                self._wake.set()
            if self._durable == self._enqueued:
                if not self.store.holds_lease():  # durable, but what else is in memory may be stale by now
                    raise NotServing(self.not_serving_reason())
                return
            done = asyncio.get_running_loop().create_future()
            self._waiters.append(done)
            await done  # then look again: other calls may have made entries while this one waited

    async def _write(self) -> None:
        """Appends pending entries in order, everything queued per store write (group commit). While many calls
        wait, writes are spaced out (``CoordinatorConfig.write_spacing``): a burst of calls then costs the store,
        and this process, a few large transactions instead of one per store round trip, and its last calls wait at
        most one spacing more.
        Fewer waiting calls (a lone caller, a few sequential clients) are never held back."""
        loop = asyncio.get_running_loop()
        last_started, last_took = -math.inf, 0.0
        while True:
            await self._wake.wait()
            tunables = self._tunables
            if len(self._waiters) >= tunables.busy_callers:
                spacing = min(tunables.write_spacing * last_took, tunables.max_write_spacing_s)
                if (linger := last_started + spacing - loop.time()) > 0:
                    await asyncio.sleep(linger)
            self._wake.clear()
            batch, self._pending = self._pending, []
            if not batch:
                continue
            epoch = self.epoch
            last_started = loop.time()
            try:
                await self.store.append(batch)
            except Exception as e:  # whatever went wrong, these entries are not known to be durable
                if not isinstance(e, StoreError):
                    log.exception("unexpected error while writing the journal")
                await self._step_down(f"the store failed: {e}")
                continue
            last_took = loop.time() - last_started
            self.on_append(last_took)
            if epoch != self.epoch:  # stepped down while writing: the waiters were failed already
                continue
            self._durable += len(batch)
            if self._durable < self._enqueued:
                continue  # a waiter woken now would find entries still queued and wait again: wake it later
            ready, self._waiters = self._waiters, []
            for done in ready:
                if not done.done():
                    done.set_result(None)
            if self._garbage.due():
                try:
                    await self._compact()
                except StoreError as e:  # a compaction cut short leaves a journal that replays the same
                    if epoch == self.epoch:
                        await self._step_down(f"the store failed while compacting the journal: {e}")
                except Exception:
                    log.exception("unexpected error while compacting the journal; it stays as it is")
                    self._garbage = compaction.Garbage()

    async def _compact(self, raw: list[bytes] | None = None, entries: list[journal.Entry] | None = None) -> None:
        """Drops what replay no longer needs from the store's journal (read again unless given, with nothing
        appended since) and starts a new estimate from what stays."""
        if raw is None or entries is None:
            raw = await self.store.load()
            entries = [journal.decode(r) for r in raw]
        keep = compaction.needed(entries, self.config.limits)
        await self.store.compact(raw, keep)
        kept = [i for i, k in enumerate(keep) if k]
        self._garbage = compaction.Garbage.of([entries[i] for i in kept], [len(raw[i]) for i in kept], compacted=True)
        log.info("compacted the journal: %d entries (%d bytes) -> %d (%d bytes)", len(raw),
                 sum(map(len, raw)), len(kept), self._garbage.total_bytes)

    async def step_aside(self, why: str, for_s: float) -> None:
        """Steps down and campaigns again only ``for_s`` seconds later: this leader suspects its own partition (most
        of the job went silent at once), so a replica the processes reach takes over and judges them itself.
        Nothing is journaled for it; the state is rebuilt from the journal whenever this replica leads again."""
        if not self.serving:
            return
        self._aside_until = self._clock() + for_s
        log.warning("standing aside for %.1fs: %s", for_s, why,
                    extra={"event": "standing_aside", "reason": why, "seconds": for_s})
        await self._step_down(f"standing aside: {why}")

    async def check_replay(self) -> None:
        """Logs whether a fresh replay of the journal gives the live state (``--check-replay``, at a graceful stop,
        once nothing makes entries any more); nothing unless this replica leads with every entry durable."""
        if self._led_in != self.epoch:  # a standby, or a leader that stepped down: its state is not the job's
            return
        try:
            await self.commit()
        except NotServing:
            return
        entries = [journal.decode(raw) for raw in await self.store.load()]
        differs = difference(self.state, self._replayed(entries))
        if differs is None:
            log.info("the journal (%d entries) replays to the live state", len(entries))
        else:
            log.error("the journal (%d entries) replays to another state than the live one: %s", len(entries),
                      differs, extra={"event": "replay_differs"})

    def stop_serving(self, why: str) -> None:
        """Refuses new calls from now on (on shutdown); writes already queued still complete."""
        self.serving, self.reason, self._stepped_down = False, why, False

    async def _rebuild(self) -> None:
        self._down.clear()
        entries = await self.store.load()
        decoded = [journal.decode(raw) for raw in entries]
        state = self._replayed(decoded)
        state.reset_liveness(self._clock())
        self._garbage = compaction.Garbage.of(decoded, [len(raw) for raw in entries], compacted=False)
        if self._garbage.due():  # a journal that grew under an earlier leader
            try:
                await self._compact(entries, decoded)
            except StoreError:
                raise
            except Exception:
                log.exception("unexpected error while compacting the journal; it stays as it is")
                self._garbage = compaction.Garbage()
        self.state, self.epoch = state, self.epoch + 1
        self._led_in = self.epoch
        self._pending, self._enqueued, self._durable = [], 0, 0
        await self._report(True)  # health says SERVING no later than the first answer
        self.serving = True
        topology = state.topology
        log.info("serving: replayed %d journal entries (%s)", len(entries),
                 f"generation {topology.generation} published" if topology else f"{state.registered} registered")
        self._on_serving()

    def _replayed(self, entries: list[journal.Entry]) -> ClusterState:
        """A fresh state that replayed ``entries``."""
        state = ClusterState(self.config)
        with wire.gc_paused():  # replay builds every generation's objects: none is garbage yet
            for entry in entries:
                state.replay(entry)
        return state

    async def _step_down(self, why: str) -> None:
        if not self._serving and self._stepped_down:
            return
        was_serving = self._serving
        self.serving, self.epoch, self._stepped_down = False, self.epoch + 1, True
        self.reason = f"this coordinator stepped down ({why}); another replica may lead"
        self.state = ClusterState(self.config)
        self._pending, self._enqueued, self._durable = [], 0, 0
        if was_serving:
            log.error("stepping down: %s", why, extra={"event": "stepping_down", "reason": why})
        await self._report(False)  # before any caller hears of it
        waiters, self._waiters = self._waiters, []
        for done in waiters:
            if not done.done():
                done.set_result(None)  # each waiter finds the epoch changed and raises NotServing
        self._on_step_down(why)
        self._down.set()
        await self.store.release()
