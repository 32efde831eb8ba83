"""What a transfer endpoint holds for its receives: the frames that arrived and were not read yet, per (source,
destination) device pair, bounded in bytes; and why each source process's latest connection failed.

The bound (``max_bytes``, ``MAX_HELD_BYTES`` by default) is on the total held for every pair, read or not: each frame
counts its payload plus ``FRAME_OVERHEAD`` bytes, and counts from before its payload is read until a receive takes
it. A frame that would pass the bound fails the connection that delivers it (its process's held frames are dropped:
what it sent broke the bound), with an error naming the pair and the bound that its receives get at once; unless
another process holds more than the sender would with the frame, and dropping that process's frames makes room:
then that process, the one that filled the bound, is failed instead (its connection hung up), so one peer that
floods pairs nobody reads cannot fail everyone else's frames.

A connection failure is recorded for its process only while that connection is the process's latest (a newer
connection from the same process replaced it: it is only logged), and is forgotten when the process connects again
and is admitted: receives from that process then wait for frames again. A receive fails at once, naming its pair,
while its process's failure is recorded and nothing is queued for its pair; frames queued before the failure are
still received first. A failure never touches another process's pairs.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from ifrt.errors import TransferError, TransferTimeout
from ifrt.ids import LOCAL_ID_BITS

MAX_HELD_BYTES = 1 << 30
"""What an endpoint holds at most for receives not made yet, over all pairs (1 GiB): ``Endpoint(max_held_bytes=)``."""
FRAME_OVERHEAD = 256
"""What each held frame counts besides its payload (its array object): a flood of empty arrays is bounded too."""


def mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


class Arrivals:
    """Frames per pair, their bytes, and each source process's recorded failure (see the module)."""

    def __init__(self, max_bytes: int = MAX_HELD_BYTES) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._frames: dict[tuple[int, int], deque[np.ndarray]] = {}
        self._held = 0
        self._held_by: dict[int, int] = {}  # source process -> bytes it holds (queued and being read)
        self._latest: dict[int, tuple[object, Callable[[], None]]] = {}  # process -> (connection, hang it up)
        self._failed: dict[int, tuple[object, TransferError]] = {}  # process -> (its failed connection, why)

    @property
    def held_bytes(self) -> int:
        """What is held now: every frame not read yet, and those being read, with their overhead."""
        with self._lock:
            return self._held

    def admitted(self, process: int, connection: object, hang_up: Callable[[], None]) -> None:
        """``connection`` now carries ``process``'s frames: an earlier failure of that process is forgotten."""
        with self._changed:
            self._latest[process] = (connection, hang_up)
            self._failed.pop(process, None)
            self._changed.notify_all()

    def closed(self, process: int, connection: object) -> None:
        """``connection`` ended (cleanly or not): it is no longer the one to hang up for ``process``."""
        with self._lock:
            if self._latest.get(process, (None,))[0] is connection:
                del self._latest[process]

    def reserve(self, process: int, connection: object, src: int, dst: int, seq: int, nbytes: int) -> None:
        """Counts a frame before its payload is read; past the bound, fails the process that filled it (see the
        module), raising the TransferError here when that is the sender."""
        cost = nbytes + FRAME_OVERHEAD
        hang_up: Callable[[], None] | None = None
        with self._changed:
            if self._held + cost > self.max_bytes:
                mine = self._held_by.get(process, 0) + cost
                hog = max(self._held_by, key=lambda p: self._held_by[p], default=process)
                theirs = self._held_by.get(hog, 0)
                if hog == process or theirs <= mine or self._held - theirs + cost > self.max_bytes:
                    error = TransferError(
                        f"transfer from process {process} failed: frame {seq} from device {src} to device {dst} "
                        f"({nbytes} bytes) would pass the "
                        f"{self.max_bytes}-byte bound ({mib(self.max_bytes)}) on what this endpoint holds for receives "
                        f"not made yet: it holds {self._held} bytes, {mine - cost} of them from process {process}; "
                        "receive what is sent, or raise the bound (Endpoint(max_held_bytes=...))")
                    self._fail(process, connection, error, drop=True)
                    raise error
                hang_up = self._evict(hog, process, src, dst)
            self._held += cost
            self._held_by[process] = self._held_by.get(process, 0) + cost
        if hang_up is not None:
            hang_up()

    def release(self, process: int, nbytes: int) -> None:
        """Uncounts a reserved frame that was not queued (its connection failed mid-payload)."""
        with self._lock:
            self._uncount(process, nbytes + FRAME_OVERHEAD)

    def put(self, process: int, src: int, dst: int, array: np.ndarray) -> None:
        """Queues a reserved frame for its pair and wakes its receive."""
        with self._changed:
            self._frames.setdefault((src, dst), deque()).append(array)
            self._changed.notify_all()

    def fail(self, process: int, connection: object, error: TransferError) -> bool:
        """Records why ``connection`` of ``process`` failed, if it is the process's latest (and nothing was recorded
        for it yet); wakes the process's receives. Returns whether it was recorded."""
        with self._changed:
            return self._fail(process, connection, error, drop=False)

    def take(self, src: int, dst: int, src_process: int, timeout: float) -> np.ndarray:
        """The next frame of the pair, within ``timeout`` seconds; at once the recorded failure of its process when
        nothing is queued for it (naming the pair); TransferTimeout after ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                frames = self._frames.get((src, dst))
                if frames:
                    array = frames.popleft()
                    if not frames:
                        del self._frames[(src, dst)]
                    self._uncount(src >> LOCAL_ID_BITS, array.nbytes + FRAME_OVERHEAD)
                    return array
                failed = self._failed.get(src_process)
                if failed is not None:
                    raise TransferError(f"receiving from device {src} (process {src_process}) on device {dst}: "
                                        f"{failed[1]}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransferTimeout(f"nothing arrived from device {src} (process {src_process}) for device "
                                          f"{dst} within {timeout}s")
                self._changed.wait(remaining)

    def _fail(self, process: int, connection: object, error: TransferError, drop: bool) -> bool:
        latest = self._latest.get(process)
        if latest is None or latest[0] is not connection:
            return False  # a newer connection took its place (or it never carried frames): only logged
        recorded = self._failed.get(process)
        if recorded is not None and recorded[0] is connection:
            return False  # the first reason stands (an eviction, then the hang-up it caused)
        self._record(process, connection, error, drop)
        return True

    def _record(self, process: int, connection: object, error: TransferError, drop: bool) -> None:
        self._failed[process] = (connection, error)
        if drop:
            for pair in [pair for pair in self._frames if pair[0] >> LOCAL_ID_BITS == process]:
                for array in self._frames.pop(pair):
                    self._uncount(process, array.nbytes + FRAME_OVERHEAD)
        self._changed.notify_all()

    def _evict(self, hog: int, process: int, src: int, dst: int) -> Callable[[], None] | None:
        """Fails ``hog``, which holds more than anyone, to make room for ``process``'s frame; its hang-up."""
        latest = self._latest.get(hog)
        held = self._held_by.get(hog, 0)
        error = TransferError(f"process {hog} held {held} bytes of frames not received, most of this endpoint's "
                              f"{self.max_bytes}-byte bound ({mib(self.max_bytes)}), when process {process}'s frame "
                              f"from device {src} to device {dst} needed room: its frames were dropped")
        self._record(hog, None if latest is None else latest[0], error, drop=True)
        return None if latest is None else latest[1]

    def _uncount(self, process: int, cost: int) -> None:
        self._held -= cost
        left = self._held_by.get(process, 0) - cost
        if left > 0:
            self._held_by[process] = left
        else:
            self._held_by.pop(process, None)

