"""Global device ids: ``global_id = process_id << 17 | local_id``.

A global id is derivable from (process id, local id), so the wire form never sends it. By default
every global id fits in a signed 32-bit int, which runtimes and compilers index devices with.
"""

from __future__ import annotations

LOCAL_ID_BITS = 17
MAX_LOCAL_DEVICES = 1 << LOCAL_ID_BITS
"""Exclusive bound on a local device id."""
MAX_PROCESSES = 1 << 14
"""Exclusive bound on a process id while global ids must fit in int32 (the default)."""
MAX_PROCESSES_INT64 = 1 << (63 - LOCAL_ID_BITS)
"""Exclusive bound on a process id when the operator opts into int64 global ids."""


def check_local_id(local_id: int) -> int:
    """Returns ``local_id`` if it is a valid local device id, else raises ValueError naming the bound."""
    if not 0 <= local_id < MAX_LOCAL_DEVICES:
        raise ValueError(f"local device id {local_id} is out of range: "
                         f"expected 0 <= local_id < {MAX_LOCAL_DEVICES} (2**17)")
    return local_id


def check_process_id(process_id: int, max_processes: int = MAX_PROCESSES) -> int:
    """Returns ``process_id`` if it is below ``max_processes``, else raises ValueError naming the bound."""
    if not 0 <= process_id < max_processes:
        raise ValueError(f"process id {process_id} is out of range: expected 0 <= process_id < {max_processes}")
    return process_id


def global_device_id(process_id: int, local_id: int, max_processes: int = MAX_PROCESSES) -> int:
    """The global id of local device ``local_id`` of process ``process_id``."""
    return check_process_id(process_id, max_processes) << LOCAL_ID_BITS | check_local_id(local_id)


def split_global_id(global_id: int, max_processes: int = MAX_PROCESSES) -> tuple[int, int]:
    """The (process_id, local_id) pair that ``global_id`` encodes."""
    if global_id < 0 or global_id >> LOCAL_ID_BITS >= max_processes:
        raise ValueError(f"global device id {global_id} is out of range: "
                         f"expected 0 <= id < {max_processes << LOCAL_ID_BITS}")
    return global_id >> LOCAL_ID_BITS, global_id & (MAX_LOCAL_DEVICES - 1)
