"""Where the coordinator's journal lives, and who may write it.

The contract, the same for every backend (tests/test_store.py runs one suite against each):

- ``acquire(advertise)`` returns once this replica leads; ``advertise`` is what followers report.
- ``load()`` returns every journal entry, oldest first.
- ``append(entries)`` makes entries durable, after all earlier ones, or raises ``StoreError``: the store is
  unreachable (``retryable``), or this replica no longer leads (``lost`` is then set). An append is
  fenced: a deposed leader's append fails; it never lands.
- ``release()`` gives up leadership at once (a standby takes over without waiting for a lease to expire).
- ``holds_lease()`` says whether this replica may still answer anything from memory: its lease cannot have expired
  at etcd yet, margin included (one clock read; always for ``memory``). ``lost`` is set soon after it turns false.
- ``compact(entries, keep)`` drops the entries a replay no longer needs: ``entries`` is what ``load()`` just
  returned (nothing appended since), ``keep`` says for each whether it stays (see ``coordinator.core.compaction``).
  Afterwards ``load()`` returns the kept entries in order. It may be applied oldest first in several steps (etcd):
  a journal compacted only in part replays to the same state. Fenced and failing like ``append``.

``memory`` keeps the journal in the process (nothing survives it; the default). ``etcd`` keeps it under
``/ifrt/<cluster-id>/`` in etcd, elects the leader with a lease, and fences every append with a
transaction on the leader key, so two coordinators can never both publish.

etcd layout: one key per append (a batch of entries), ``journal/<batch number, 16 digits>``, numbered from 0 in
the order written; its value is a version byte (1) and then each entry as a 4-byte big-endian length and its bytes.
A compaction rewrites old batches oldest first, one transaction per run of batches holding at most
``MAX_BATCH_BYTES`` of kept entries: the run's first key gets them and the others are deleted (numbers then have
gaps; the next append takes the number after the highest). etcd keeps the replaced revisions until its own
compaction: run etcd with ``--auto-compaction-retention`` for its database to shrink too.
A batch larger than ``MAX_BATCH_BYTES`` is split over several keys, one transaction each. Each transaction
compares the leader key's create revision, the attempt, and that its key is new, and puts one key: etcd
does one write per batch, whatever the batch holds.

Job attempts (``--attempt N``): each attempt has its own journal (attempt 0 under ``journal/``, attempt N under
``attempts/N/journal/``) and ``attempt`` holds the newest attempt that led. A replica of a newer attempt takes
over with a fresh journal and deletes the older one in the same transaction; a replica of an older attempt never
leads again, and every append also compares on ``attempt``, so the old attempt cannot write.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from coordinator.etcd_client import etcd_client, ip_endpoint
from coordinator.journal_batches import MAX_BATCH_BYTES, batch_value, compaction_runs, pack_counted, unpack_batch
from ifrt.hostport import split_host_port

log = logging.getLogger("ifrt.coordinator")

ETCD_SCHEME = "etcd://"
MIN_LEASE_TTL_S = 2
"""The shortest ``--leader-ttl`` whose margin holds with a renewal every third of it (``check_lease_ttl``)."""
RENEW_RETRY_S = 0.1
"""Pause before a failed lease renewal is tried again (on the next etcd member, see coordinator.etcd_client)."""


def lease_margin(ttl_s: float) -> float:
    """How long before its lease can expire at etcd a leader stops answering: 10% of the TTL, at least 0.5 s. It
    covers the clocks of this host and of etcd's leader running at different rates and the time between the check
    and the answer leaving this process (an event loop turn); the lease is counted from when a renewal was sent,
    which is before etcd renewed it."""
    return max(0.5, 0.1 * ttl_s)


def check_lease_ttl(ttl_s: float) -> None:
    """ValueError unless a lease of ``ttl_s`` seconds leaves room for a renewal to be retried before the margin: a
    renewal is due a third of the TTL after the last one was sent, the leader serves until the TTL less the margin,
    and that leaves at least another third for a retry."""
    if ttl_s < MIN_LEASE_TTL_S or ttl_s - lease_margin(ttl_s) - ttl_s / 3 < ttl_s / 3:
        raise ValueError(f"--leader-ttl {ttl_s} is too short: a leader stops answering {lease_margin(ttl_s):g} s "
                         "before its lease can expire at etcd and renews it every third of the TTL, which leaves no "
                         f"time to retry a renewal; expected at least {MIN_LEASE_TTL_S} seconds")


class StoreError(RuntimeError):
    """The journal could not be read or written; ``retryable`` unless leadership was lost."""

    def __init__(self, message: str, *, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


class Store(Protocol):
    description: str
    lost: asyncio.Event
    leader: str | None
    """The address the current leader advertised, when another replica leads."""
    leader_attempt: int | None
    """The job attempt the current leader serves, when another replica of an older attempt holds on to the lead."""
    serves_until: float
    """Until when (``time.monotonic()``) this replica may answer from memory: its lease cannot have expired before
    then, margin included. ``math.inf`` for a store without leases; ``-math.inf`` while it does not lead."""

    def holds_lease(self) -> bool:
        """Whether this replica may still answer from memory (one clock read)."""
        ...

    async def acquire(self, advertise: str) -> None: ...
    async def load(self) -> list[bytes]: ...
    async def append(self, entries: list[bytes]) -> None: ...
    async def compact(self, entries: list[bytes], keep: list[bool]) -> None: ...
    async def release(self) -> None: ...
    async def close(self) -> None: ...


class MemoryStore:
    """The journal in this process: one coordinator, nothing survives it."""

    description = "memory"
    leader = None
    leader_attempt = None
    serves_until = math.inf

    def __init__(self) -> None:
        self.lost = asyncio.Event()
        self._entries: list[bytes] = []

    def holds_lease(self) -> bool:
        return True

    async def acquire(self, advertise: str) -> None:
        return None

    async def load(self) -> list[bytes]:
        return list(self._entries)

    async def append(self, entries: list[bytes]) -> None:
        self._entries.extend(entries)

    async def compact(self, entries: list[bytes], keep: list[bool]) -> None:
        _check_compaction(len(self._entries), entries, keep)
        self._entries = [entry for entry, kept in zip(self._entries, keep, strict=True) if kept]

    async def release(self) -> None:
        return None

    async def close(self) -> None:
        return None


@dataclass(frozen=True)
class EtcdAccess:
    """How to reach etcd when it is secured: TLS (``ca``, and ``cert``/``key`` for client certificates) and a
    user with its password. All optional: none means plaintext without authentication."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)

    def describe(self) -> str:
        return ", ".join(filter(None, ["TLS" if self.ca else "", "client certificate" if self.cert else "",
                                       f"user {self.user}" if self.user else ""])) or "plaintext"


class EtcdStore:
    """The journal in etcd, one key per batch of entries; leadership through a lease on ``leader``.

    The lease: this replica answers from memory only until ``serves_until``, the send time of the grant or of the
    last renewal etcd answered, plus the TTL, less ``lease_margin``; etcd counts the TTL from when it received the
    request, later. A renewal is sent every third of the TTL, each try bounded so that it ends by then, and tried
    again (on another member) at once when it fails; once ``serves_until`` passes, ``lost`` is set.

    etcd members: every request carries etcd's ``hasleader`` mark (coordinator.etcd_client), so a member cut from the
    majority refuses it at once instead of holding it, and the request goes to the next member."""

    def __init__(self, endpoints: list[str], cluster_id: str, *, lease_ttl_s: int = 5,
                 timeout_s: float = 3.0, access: EtcdAccess = EtcdAccess(), attempt: int = 0) -> None:
        check_lease_ttl(lease_ttl_s)
        self.description = f"etcd {','.join(endpoints)} under /ifrt/{cluster_id}/"
        self.lost = asyncio.Event()
        self.leader: str | None = None
        self.leader_attempt: int | None = None
        tls: dict = {}
        if access.ca:
            tls = {"ca_cert": _read(access.ca), "cert_key": _read(access.key), "cert_chain": _read(access.cert)}
            # Endpoints are dialled by IP (one channel for all): check certificates against the first name given.
            tls["tls_server_name"] = split_host_port(endpoints[0])[0]
        self._access = access
        self._client = etcd_client([ip_endpoint(e) for e in endpoints], tls)
        self._prefix = f"/ifrt/{cluster_id}/".encode()
        self._leader_key = self._prefix + b"leader"
        self._attempt_key = self._prefix + b"attempt"
        self._attempt = attempt
        self._journal_prefix = self._journal_of(attempt)
        if attempt:
            self.description += f" (attempt {attempt})"
        self._ttl = lease_ttl_s
        self._margin = lease_margin(lease_ttl_s)
        self._timeout = timeout_s
        self._lease = 0
        self.serves_until = -math.inf
        self._leader_revision = 0
        self._next = 0
        self._layout: list[tuple[int, int]] = []  # (batch number, entries) of the journal as loaded and appended
        self._keepalive: asyncio.Task | None = None
        self._connected = False

    async def _kv(self):  # etcd3aio KVService
        if not self._connected:
            await self._client.connect()
            self._connected = True
            if self._access.user:
                await self._authenticate()
        return self._client.kv

    async def _authenticate(self) -> None:
        """Logs in as the configured user; the token then goes with every call (etcd renews it while in use)."""
        from etcd3aio import EtcdError

        try:
            answer = await self._client.auth.authenticate(self._access.user, self._access.password or "",
                                                          timeout=self._timeout)
        except (EtcdError, TimeoutError, grpc.RpcError) as e:
            self._connected = False
            await self._client.close()
            raise StoreError(f"etcd refused user {self._access.user!r} ({self.description}): {e}") from e
        self._client.set_token(answer.token)

    def holds_lease(self) -> bool:
        """Whether the lease cannot have expired at etcd yet, margin included: one clock read."""
        return time.monotonic() < self.serves_until

    def _journal_of(self, attempt: int) -> bytes:
        return self._prefix + (b"journal/" if attempt == 0 else f"attempts/{attempt}/journal/".encode())

    async def acquire(self, advertise: str) -> None:
        """Campaigns until this replica holds the leader key; logs who leads meanwhile. A replica of an attempt
        older than the newest that led never leads (it logs that and keeps standing by)."""
        from etcd3aio import EtcdError, SortOrder, SortTarget, prefix_range_end

        reported = None
        while True:
            try:
                kv = await self._kv()
                found = (await kv.get(self._attempt_key, timeout=self._timeout)).kvs
                newest = int(found[0].value) if found else None
                if newest is not None and newest > self._attempt:
                    if reported != "superseded":
                        log.error("this replica serves attempt %d, but attempt %d of the job has started "
                                  "(%s): it will not lead", self._attempt, newest, self.description)
                        reported = "superseded"
                    await asyncio.sleep(1.0)
                    continue
                same = ([kv.txn_compare_value(self._attempt_key, str(newest))] if newest is not None
                        else [kv.txn_compare_version(self._attempt_key, 0)])
                fresh = []
                if newest is not None and newest < self._attempt:  # the old attempt's journal goes with it
                    old = self._journal_of(newest)
                    fresh = [kv.txn_op_delete(old, range_end=prefix_range_end(old))]
                sent = time.monotonic()  # the lease runs at most from here
                lease = await self._client.lease.grant(self._ttl, timeout=self._timeout)
                won = await kv.txn(
                    [kv.txn_compare_create_revision(self._leader_key, 0), *same],
                    [kv.txn_op_put(self._leader_key, advertise.encode(), lease=lease.ID),
                     kv.txn_op_put(self._attempt_key, str(self._attempt).encode()), *fresh],
                    [kv.txn_op_get(self._leader_key)],
                    timeout=self._timeout, max_attempts=1)
                if won.succeeded and newest is not None and newest < self._attempt:
                    log.warning("attempt %d of the job starts with an empty journal; attempt %d is fenced off "
                                "and its journal deleted (%s)", self._attempt, newest, self.description)
                if won.succeeded:
                    self._lease, self._leader_revision, self.leader = lease.ID, won.header.revision, advertise
                    last = (await kv.get(self._journal_prefix, prefix_range_end(self._journal_prefix),
                                         keys_only=True, limit=1, sort_order=SortOrder.DESCEND,
                                         sort_target=SortTarget.KEY, timeout=self._timeout)).kvs
                    try:
                        self._next = self._number(bytes(last[0].key)) + 1 if last else 0
                    except ValueError:
                        self._next = 0  # load() names the key that is not a batch
                    self._layout = []
                    self.lost.clear()
                    self.serves_until = sent + min(self._ttl, lease.TTL) - self._margin
                    self._keepalive = asyncio.create_task(self._keep_alive(lease.ID, sent))
                    log.info("leading cluster (%s)", self.description)
                    return
                await self._client.lease.revoke(lease.ID, timeout=self._timeout)
                holders = won.responses[0].response_range.kvs
                leader = self.leader = holders[0].value.decode() if holders else None
                self.leader_attempt = newest if newest is not None and newest < self._attempt else None
                if leader != reported:
                    if self.leader_attempt is None:
                        log.info("standing by: the coordinator at %s leads (%s)", leader, self.description)
                    else:
                        log.warning("standing by: the coordinator at %s leads attempt %d of the job; this replica "
                                    "serves attempt %d and takes over once attempt %d's coordinators stop: stop "
                                    "them (%s)", leader, newest, self._attempt, newest, self.description)
                    reported = leader
            except (EtcdError, TimeoutError, grpc.RpcError, StoreError) as e:
                self.leader = None
                if reported != "unreachable":
                    log.error("etcd is unreachable (%s): %s; retrying", self.description, e)
                    reported = "unreachable"
                if _auth_expired(e):
                    self._connected = False  # log in again on the next attempt
            await asyncio.sleep(0.25)

    async def load(self) -> list[bytes]:
        from etcd3aio import EtcdError, prefix_range_end

        kv = await self._kv()
        try:
            found = await kv.get(self._journal_prefix, prefix_range_end(self._journal_prefix), timeout=self._timeout)
        except (EtcdError, TimeoutError, grpc.RpcError) as e:  # etcd3aio times out with the builtin TimeoutError
            raise StoreError(f"cannot read the journal from {self.description}: {e}") from e
        batches = sorted((bytes(item.key), bytes(item.value)) for item in found.kvs)
        entries: list[bytes] = []
        layout: list[tuple[int, int]] = []
        for key, value in batches:
            try:
                unpacked = unpack_batch(value)
                layout.append((self._number(key), len(unpacked)))
            except ValueError as e:
                raise StoreError(f"cannot read the journal from {self.description}: key {key.decode()!r}: {e}",
                                 retryable=False) from e
            entries.extend(unpacked)
        self._next = layout[-1][0] + 1 if layout else 0
        self._layout = layout
        return entries

    def _number(self, key: bytes) -> int:
        """The batch number of a journal key; ValueError if the key is not one."""
        suffix = key[len(self._journal_prefix):]
        if not suffix.isdigit():
            raise ValueError("not a journal batch key (expected 16 digits after the journal prefix)")
        return int(suffix)

    def _key(self, number: int) -> bytes:
        return self._journal_prefix + f"{number:016d}".encode()

    async def append(self, entries: list[bytes]) -> None:
        from etcd3aio import EtcdError

        kv = await self._kv()
        for value, count in pack_counted(entries, MAX_BATCH_BYTES):
            key = self._key(self._next)
            await self._fenced(kv, [kv.txn_compare_version(key, 0)], [kv.txn_op_put(key, value)], EtcdError)
            self._layout.append((self._next, count))
            self._next += 1

    async def _fenced(self, kv, compare: list, ops: list, etcd_error: type) -> None:
        """One transaction that lands only while this replica leads this attempt; StoreError otherwise."""
        fence = [kv.txn_compare_create_revision(self._leader_key, self._leader_revision),
                 kv.txn_compare_value(self._attempt_key, str(self._attempt)), *compare]
        try:  # one attempt: a blind retry of a transaction that did land would fail its own fence
            done = await kv.txn(fence, ops, timeout=self._timeout, max_attempts=1)
        except (etcd_error, TimeoutError, grpc.RpcError) as e:
            raise StoreError(f"cannot write the journal to {self.description}: {e}") from e
        if not done.succeeded:
            self.lost.set()
            raise StoreError("this coordinator no longer leads (the leader key changed): stepping down",
                             retryable=False)

    async def compact(self, entries: list[bytes], keep: list[bool]) -> None:
        """Rewrites the batches oldest first, each run of them in one fenced transaction (see the module)."""
        from etcd3aio import EtcdError

        _check_compaction(sum(count for _, count in self._layout), entries, keep)
        kv = await self._kv()
        # a failure midway leaves no layout to trust
        runs, self._layout = compaction_runs(self._layout, entries, keep), []
        layout: list[tuple[int, int]] = []
        for run in runs:
            numbers, kept = [number for number, _, _ in run], [e for _, batch, _ in run for e in batch]
            if len(run) > 1 or run[0][2]:  # a single unchanged batch stays as it is
                ops = [kv.txn_op_put(self._key(numbers[0]), batch_value(kept)) if kept
                       else kv.txn_op_delete(self._key(numbers[0]))]
                if len(numbers) > 1:
                    ops.append(kv.txn_op_delete(self._key(numbers[1]), range_end=self._key(numbers[-1] + 1)))
                await self._fenced(kv, [], ops, EtcdError)
            if kept:
                layout.append((numbers[0], len(kept)))
        self._layout = layout

    async def release(self) -> None:
        self.leader = None
        self.serves_until = -math.inf
        lease, self._lease = self._lease, 0  # the renewal loop ends when it sees the lease is no longer held
        if self._keepalive is not None:
            self._keepalive.cancel()
            self._keepalive = None
        if lease:
            try:
                async with asyncio.timeout(self._timeout):  # etcd's client retries on its own; bound it all
                    await self._client.lease.revoke(lease, timeout=self._timeout, max_attempts=1)
            except Exception as e:  # the lease then expires on its own
                log.warning("could not give up leadership at once: %s", e)

    async def close(self) -> None:
        await self.release()
        if self._connected:
            await self._client.close()

    async def _keep_alive(self, lease: int, sent: float) -> None:
        """Renews the lease a third of its TTL after the last renewal was sent, each try bounded so that it ends
        by ``serves_until`` and failed tries repeated at once; moves ``serves_until`` on from each renewal's send
        time; sets ``lost`` once it has passed."""
        due, failing = sent + self._ttl / 3, 0
        while True:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            if self._lease != lease:  # released (the client library may swallow a cancellation)
                return
            sent = time.monotonic()
            if (left := self.serves_until - sent) <= 0:
                break
            try:
                async with asyncio.timeout(min(self._timeout, self._ttl / 3, left)):
                    ttl = await self._renew(lease)
            except Exception as e:  # etcd without a majority does not answer at all: the timeout ends the try
                failing += 1
                why = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e) or type(e).__name__
                (log.debug if failing > 1 else log.warning)("lease renewal failed (%d in a row; trying again, on "
                                                            "another etcd member if there is one): %s", failing, why)
                due = min(time.monotonic() + RENEW_RETRY_S, self.serves_until)
                continue
            if self._lease != lease:
                return
            if ttl <= 0:
                log.error("leadership lost: etcd says the lease expired")
                self.serves_until = -math.inf
                break
            self.serves_until, due, failing = sent + min(ttl, self._ttl) - self._margin, sent + self._ttl / 3, 0
        if self._lease == lease:
            log.error("leadership lost: the lease was not renewed in time (%.1fs margin before it may expire at "
                      "etcd)", self._margin)
            self.lost.set()

    async def _renew(self, lease: int) -> int:
        """One renewal of ``lease``: the TTL etcd gives it from now (0 or less: it has expired)."""
        call = self._client.lease.keep_alive(lease)
        try:
            async for answer in call:
                return answer.TTL
        finally:
            call.cancel()
        raise StoreError("etcd ended the lease renewal without an answer")


def open_store(spec: str, cluster_id: str, lease_ttl_s: int = 5, access: EtcdAccess | None = None, *,
               attempt: int = 0) -> Store:
    """``memory`` or ``etcd://host:port[,host:port...]`` (its journal for job attempt ``attempt``); ValueError
    naming the expected forms."""
    if spec == "memory":
        return MemoryStore()
    if spec.startswith(ETCD_SCHEME):
        endpoints = [e for e in spec[len(ETCD_SCHEME):].split(",") if e]
        if not endpoints or any(":" not in e for e in endpoints):
            raise ValueError(f"--store {spec!r}: expected etcd://HOST:PORT[,HOST:PORT...]")
        try:
            return EtcdStore(endpoints, cluster_id, lease_ttl_s=lease_ttl_s, access=access or EtcdAccess(),
                             attempt=attempt)
        except ImportError:
            raise ValueError("--store etcd needs the etcd client: pip install 'ifrt-topology[etcd]'") from None
    raise ValueError(f"--store {spec!r}: expected memory or etcd://HOST:PORT[,HOST:PORT...]")


def _check_compaction(held: int, entries: list[bytes], keep: list[bool]) -> None:
    if not held == len(entries) == len(keep):
        raise StoreError(f"cannot compact: the journal holds {held} entries, the compaction was decided on "
                         f"{len(entries)} with {len(keep)} marks (load() it again)", retryable=False)


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


def _auth_expired(error: Exception) -> bool:
    return "auth token" in str(error).lower()


