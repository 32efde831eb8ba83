"""One coordinator replica's life: win leadership, rebuild the state from the journal, serve, and step down
when the store is lost, then start over. Writes reach the store in the order the state machine made them.

    standby ──(acquire)──▶ replaying ──(journal replayed)──▶ serving ──(store lost / append failed)──▶ standby
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from coordinator import journal
from coordinator.state import ClusterConfig, ClusterState
from coordinator.store import Store, StoreError

log = logging.getLogger("ifrt.coordinator")


class NotServing(RuntimeError):
    """This replica cannot answer now (a standby, or it lost its store); clients should try another."""


class Replica:
    """Holds the current ``state`` while this replica leads; ``epoch`` changes whenever the state is rebuilt."""

    def __init__(self, config: ClusterConfig, store: Store, advertise: str, clock: Callable[[], float],
                 on_serving: Callable[[], None], on_step_down: Callable[[str], None]) -> None:
        self.config = config
        self.store = store
        self.state = ClusterState(config)
        self.epoch = 0
        self.serving = False
        self.reason = f"this replica stands by ({store.description})"
        self._advertise = advertise
        self._clock = clock
        self._on_serving = on_serving
        self._on_step_down = on_step_down
        self._queue: list[tuple[list[bytes], asyncio.Future]] = []
        self._wake = asyncio.Event()
        self._down = asyncio.Event()

    def check(self) -> None:
        """Raises NotServing (saying why) unless this replica leads and has replayed its journal."""
        if not self.serving:
            leader = self.store.leader
            raise NotServing(f"{self.reason}; the coordinator at {leader} leads" if leader else self.reason)

    async def run(self) -> None:
        """Leads whenever it can, until cancelled."""
        writer = asyncio.create_task(self._write())
        try:
            while True:
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
                self._down.clear()
        finally:
            writer.cancel()

    async def commit(self) -> None:
        """Makes the state machine's new journal entries durable; NotServing if the store failed (the state
        that made them is then discarded, so nothing unpersisted is ever answered from)."""
        entries = self.state.take_journal()
        if not entries:
            return
        epoch = self.epoch
        done = asyncio.get_running_loop().create_future()
        self._queue.append(([journal.encode(e) for e in entries], done))
        self._wake.set()
        await done
        if epoch != self.epoch:
            raise NotServing(self.reason)

    async def _write(self) -> None:
        """Appends queued entries in order, many calls' worth per store write."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._queue = self._queue, []
            if not batch:
                continue
            try:
                await self.store.append([entry for entries, _ in batch for entry in entries])
            except StoreError as e:
                await self._step_down(f"the store failed: {e}")
                for _, done in batch:
                    done.set_exception(NotServing(self.reason))
                continue
            for _, done in batch:
                done.set_result(None)

    def stop_serving(self, why: str) -> None:
        """Refuses new calls from now on (on shutdown); writes already queued still complete."""
        self.serving, self.reason = False, why

    async def _rebuild(self) -> None:
        entries = await self.store.load()
        state = ClusterState(self.config)
        for raw in entries:
            state.replay(journal.decode(raw))
        state.reset_liveness(self._clock())
        self.state, self.epoch, self.serving = state, self.epoch + 1, True
        topology = state.topology
        log.info("serving: replayed %d journal entries (%s)", len(entries),
                 f"generation {topology.generation} published" if topology else f"{state.registered} registered")
        self._on_serving()

    async def _step_down(self, why: str) -> None:
        if not self.serving:
            return
        self.serving, self.epoch = False, self.epoch + 1
        self.reason = f"this coordinator stepped down ({why}); another replica may lead"
        self.state = ClusterState(self.config)
        log.error("stepping down: %s", why)
        self._on_step_down(why)
        self._down.set()
        await self.store.release()
