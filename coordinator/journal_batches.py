"""The journal's entries as etcd values: a batch is a version byte (1), then each entry as a 4-byte big-endian length
and its bytes, at most ``MAX_BATCH_BYTES`` of entries per value; and which batches one compaction transaction rewrites
(see coordinator/store.py's layout)."""

from __future__ import annotations

import struct

MAX_BATCH_BYTES = 1 << 20
"""Entry bytes per etcd key: etcd refuses requests over --max-request-bytes (1.5 MiB by default). A single
entry larger than this still goes in a key of its own."""
BATCH_VERSION = b"\x01"
MAX_COMPACTED_BATCHES = 1000
"""Batches one compaction transaction merges at most (a range deletion and one put, whatever the count)."""
_LENGTH = struct.Struct(">I")


def pack_batches(entries: list[bytes], limit: int = MAX_BATCH_BYTES) -> list[bytes]:
    """``entries`` as etcd values in order, each at most ``limit`` bytes of entries (an entry over it alone)."""
    return [value for value, _ in pack_counted(entries, limit)]


def pack_counted(entries: list[bytes], limit: int) -> list[tuple[bytes, int]]:
    """``pack_batches`` with the number of entries in each value."""
    values: list[tuple[bytes, int]] = []
    batch: list[bytes] = []
    size = 0
    for entry in entries:
        if batch and size + len(entry) > limit:
            values.append((batch_value(batch), len(batch)))
            batch, size = [], 0
        batch.append(entry)
        size += len(entry)
    if batch:
        values.append((batch_value(batch), len(batch)))
    return values


def batch_value(entries: list[bytes]) -> bytes:
    """One etcd value holding ``entries``."""
    return b"".join([BATCH_VERSION, *(part for entry in entries for part in (_LENGTH.pack(len(entry)), entry))])


def compaction_runs(layout: list[tuple[int, int]], entries: list[bytes],
          keep: list[bool]) -> list[list[tuple[int, list[bytes], bool]]]:
    """The batches as runs that one transaction rewrites each: (batch number, its kept entries, whether any was
    dropped) for consecutive batches holding at most ``MAX_BATCH_BYTES`` of kept entries (a batch over it alone)."""
    runs: list[list[tuple[int, list[bytes], bool]]] = []
    run: list[tuple[int, list[bytes], bool]] = []
    size = at = 0
    for number, count in layout:
        kept = [entry for entry, k in zip(entries[at:at + count], keep[at:at + count], strict=True) if k]
        at += count
        kept_size = sum(len(entry) for entry in kept)
        if run and (size + kept_size > MAX_BATCH_BYTES or len(run) >= MAX_COMPACTED_BATCHES):
            runs.append(run)
            run, size = [], 0
        run.append((number, kept, len(kept) < count))
        size += kept_size
    if run:
        runs.append(run)
    return runs


def unpack_batch(value: bytes) -> list[bytes]:
    """The entries ``pack_batches`` put in one value; ValueError if it is not one."""
    if value[:1] != BATCH_VERSION:
        raise ValueError(f"not a journal batch of version {BATCH_VERSION[0]} (it starts {value[:8]!r})")
    entries = []
    at, end = 1, len(value)
    while at < end:
        if at + _LENGTH.size > end:
            raise ValueError(f"truncated entry length at byte {at} of {end}")
        (length,) = _LENGTH.unpack_from(value, at)
        at += _LENGTH.size
        if at + length > end:
            raise ValueError(f"entry of {length} bytes at byte {at} runs past the end ({end})")
        entries.append(value[at:at + length])
        at += length
    return entries
