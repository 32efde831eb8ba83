"""The process groups ifrt starts, kept from their start until a recovery after the one that left them; leaving a
group for a recovery: abort it, shut down the connections it opened (so a peer waiting on this process in a
collective returns at once) and destroy it as the default group, while it and the DDP modules built on it stay alive
(gloo's destructor can deadlock, see ``retire``)."""

from __future__ import annotations

import contextlib
import ctypes
import logging
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from ifrt.torch import sockets

log = logging.getLogger("ifrt.torch")


@contextlib.contextmanager
def opening(excluded_ports: frozenset[int]) -> Iterator[None]:
    """Around the start of the default group: records the TCP connections it opens (less those with a port in
    ``excluded_ports``: the coordinator's and the transfer endpoints'), which ``leave`` shuts down, and keeps the
    group it started (``_hold``)."""
    global _sockets
    _sockets = sockets.Opened(excluded_ports)
    with _sockets.watch():
        yield
    if dist.is_initialized():
        _hold(dist.distributed_c10d._get_default_group())


def _hold(group: Any) -> None:
    """Keeps ``group`` alive from its start: nothing the program drops, at its end or while a collective's tensors
    are still in gloo's threads, runs gloo's destructor with the GIL held (a DDP's reducer, the group's last holder
    once the program destroyed it, did: the destructor joined a gloo thread that waited for the GIL to free the
    tensors of the program's last all_gather, and the process hung at its exit). A recovery retires it
    (``leave``); a group left or replaced otherwise goes as retired ones do."""
    global _held
    if _held is not None:
        _retired.append((_left, _held))
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
    _held = group


def leave() -> None:
    """Aborts the default process group (if any) and lets it go: nothing of it is used again, its connections nor
    its keys. The group is retired, not destroyed (``retire``)."""
    global _left, _held
    _left += 1
    group = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
    if group is not None and group is _held:
        _retired.append((_left, group))  # held since its start: retired without another reference
        _held = None
    else:
        retire(group)
    abort_all()
    shut = _sockets.shut_down()  # a peer waiting on this process in a collective returns at once
    log.debug("left the process group: %d of its sockets shut down", shut)
    if dist.is_initialized():
        dist.destroy_process_group()


_left = 0
"""How many groups this process has left (aborted for a recovery)."""
_sockets = sockets.Opened()
"""The TCP sockets the current default group opened (gloo's connections to its peers)."""
_held: Any | None = None
"""The default group ifrt started last, kept alive since its start (``_hold``) until it is retired."""
_retired: list[tuple[int, Any]] = []
"""What was built on the groups left (the groups, the DDP modules on them), each with the count of groups left
when it was retired."""


def retire(thing: Any | None) -> None:
    """Keeps an aborted group, or a DDP module built on one, alive until this process has left one more group
    (``release_retired``, at the end of the next recovery): gloo's destructor, and a DDP's whose reducer still has
    work queued, waits holding the GIL for work on a peer that is gone, while that work's end needs the GIL (a
    deadlock seen when an aborted DDP was collected at once: the process then sent no heartbeat and was declared
    failed). By then that work has long ended. The extra reference is never dropped by Python itself, so nothing
    still retired at the program's end is torn down. None: nothing to keep."""
    if thing is None:
        return
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(thing))
    _retired.append((_left, thing))


def release_retired() -> None:
    """Destroys what was retired before the last group was left: their sockets, threads and buffers go, and the
    memory they held goes back to the system (glibc keeps freed blocks otherwise, and a process's size would climb
    by a DDP's buckets per recovery)."""
    released = False
    while _retired and _retired[0][0] < _left:
        _, thing = _retired.pop(0)
        ctypes.pythonapi.Py_DecRef(ctypes.py_object(thing))
        del thing
        released = True
    if released and _malloc_trim is not None:
        _malloc_trim(0)


def _libc_malloc_trim() -> Any:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return None


_malloc_trim = _libc_malloc_trim()


def abort_all() -> None:
    """Aborts every process group, so that a collective blocked on a hung peer returns."""
    if dist.is_initialized():
        dist.distributed_c10d._abort_process_group()
