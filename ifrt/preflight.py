"""Pre-flight: can every process reach its peers' transfer endpoints? Checked right after discovery.

A job whose hosts cannot reach each other on the transfer ports (a firewall, an endpoint bound to the wrong
interface) otherwise hangs later, in its first transfer or collective. ``Client.preflight(timeout)`` (and
``ifrt doctor``, and ``discover()`` under ``IFRT_PREFLIGHT=1``) runs in every process of the job at once:

1. Each process probes the transfer endpoints of the peers its plan names (``peers``): a TCP connection and
   the transfer protocol's HELLO frame (and, in a job with a cluster token, the answer to the endpoint's token
   challenge), closed at once. The peer's endpoint takes it as a connection that ended cleanly between frames,
   so nothing is logged there. A probe waits at most ``probe_timeout`` seconds.
2. A process whose probes failed stores them in the coordinator's key-value store under
   ``ifrt/preflight/g<generation>/<fingerprint[:16]>/r<run>/failed/<process id>`` (healthy processes store
   nothing, so a large job reads back only its failures), then every process meets the others at the barrier
   of the same name (``BarrierTimeout`` names a process that never got there) and reads every failure back.
3. Every process then holds the same ``PreflightReport``: each unreachable pair by process id, host and
   address, and why (refused, timed out, no route).

The plan: up to ``ALL_PAIRS_MAX`` processes, every process probes every other one (n * (n - 1) probes). Above,
each probes its two ring neighbours (process p: p - 1 and p + 1, modulo n) and ``SAMPLE`` further peers drawn
at random with a seed every process derives alike (the topology's fingerprint and its own id), so the plan is
the same whoever computes it. The ring guarantees that every endpoint is probed by two peers (a host whose
port is blocked to everyone is always found); the sample finds a fault between two particular hosts with a
probability of about (2 + SAMPLE) / n per run.

``<run>`` counts this client's pre-flights, so a process that checks twice uses fresh keys; the processes of a
job run the same checks in the same order. A job restarted against a durable (etcd) journal that keeps its
generation reuses the keys of its earlier start: pass ``attempt=`` with a value new to that job.
"""

from __future__ import annotations

import json
import logging
import random
import socket
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ifrt.client_config import DEFAULTS
from ifrt.errors import InvalidArgument, PreflightFailed
from ifrt.hostport import split_host_port
from ifrt.records import Process
from ifrt.transfer.frames import CHALLENGE_BYTES, HELLO, connect, encode_header, token_proof

if TYPE_CHECKING:
    from ifrt.topology import Topology

log = logging.getLogger("ifrt.preflight")

ALL_PAIRS_MAX = 64
"""Up to this many processes, every process probes every other one: 4032 connections in all at 64, each
process opening 63 at once, which any host takes in a fraction of a second."""
SAMPLE = 8
"""Above ALL_PAIRS_MAX, the random peers each process probes besides its two ring neighbours. Both shape the plan
that every process computes alike: they are not tunables (the probes' timings are, in ``ClientConfig``)."""
KEY_ROOT = "ifrt/preflight"


class Gathering(Protocol):
    """The coordinator's calls through which a pre-flight gathers every process's results (``Client`` has them)."""

    def kv_set(self, key: str, value: bytes, *, allow_overwrite: bool = False, timeout: float = 60.0) -> None: ...

    def barrier(self, name: str, timeout: float, process_ids: Sequence[int] | None = None) -> None: ...

    def kv_dir(self, prefix: str, timeout: float = 60.0) -> dict[str, bytes]: ...



@dataclass(frozen=True)
class Unreachable:
    """Process ``source`` could not reach the transfer endpoint of process ``target``."""

    source: Process
    target: Process
    error: str

    def __str__(self) -> str:
        s, t = self.source, self.target
        source = split_host_port(s.address)[0] or "no endpoint"
        return (f"process {s.process_id} ({s.hostname}, {source}) cannot reach process "
                f"{t.process_id} ({t.hostname}) at {t.address}: {self.error}")

    def to_dict(self) -> dict[str, Any]:
        return {"source": {"process_id": self.source.process_id, "hostname": self.source.hostname,
                           "address": self.source.address},
                "target": {"process_id": self.target.process_id, "hostname": self.target.hostname,
                           "address": self.target.address},
                "error": self.error}


@dataclass(frozen=True)
class PreflightReport:
    """The same in every process of one check: what was probed and each pair that failed."""

    generation: int
    fingerprint: str
    num_processes: int
    pairs_probed: int
    """Directed pairs (source, target) probed by the whole job."""
    all_pairs: bool
    """Whether every pair was probed (the job has at most ALL_PAIRS_MAX processes), or a ring and a sample."""
    unreachable: tuple[Unreachable, ...]
    without_endpoint: tuple[int, ...] = ()
    """Processes that advertised no transfer endpoint (clients made with ``transfer=False``): not probed."""
    seconds: float = field(default=0.0, compare=False)
    """How long this process's check took."""

    @property
    def ok(self) -> bool:
        return not self.unreachable

    def describe(self) -> str:
        how = "all pairs" if self.all_pairs else f"ring and {SAMPLE} random peers each"
        head = (f"pre-flight of generation {self.generation} (fingerprint {self.fingerprint[:12]}...): "
                f"{self.pairs_probed} pairs of {self.num_processes} processes probed ({how}) in {self.seconds:.1f}s")
        if self.without_endpoint:
            head += f"; not probed, no transfer endpoint: processes {list(self.without_endpoint)}"
        if self.ok:
            return f"{head}: every transfer endpoint is reachable"
        lines = [f"{head}: {len(self.unreachable)} unreachable"]
        lines += [f"  {u}" for u in self.unreachable]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "generation": self.generation, "fingerprint": self.fingerprint,
                "num_processes": self.num_processes, "pairs_probed": self.pairs_probed, "all_pairs": self.all_pairs,
                "without_endpoint": list(self.without_endpoint), "seconds": round(self.seconds, 3),
                "unreachable": [u.to_dict() for u in self.unreachable]}


def peers(process_id: int, num_processes: int, seed: str, *, all_pairs_max: int = ALL_PAIRS_MAX,
          sample: int = SAMPLE) -> list[int]:
    """The processes ``process_id`` probes, in ascending order; the same list wherever it is computed.

    >>> peers(1, 4, "f00d")
    [0, 2, 3]
    >>> len(peers(7, 1000, "f00d"))  # two ring neighbours (6, 8) and 8 sampled peers
    10
    """
    if not 0 <= process_id < num_processes:
        raise InvalidArgument(f"process id {process_id} is out of range: expected 0 <= process_id < {num_processes}")
    if num_processes <= all_pairs_max:
        return [q for q in range(num_processes) if q != process_id]
    chosen = {(process_id - 1) % num_processes, (process_id + 1) % num_processes}
    rng = random.Random(f"{seed}/{process_id}")  # str seeds hash with sha512: the same in every process
    want = min(num_processes - 1, len(chosen) + sample)
    while len(chosen) < want:
        q = rng.randrange(num_processes)
        if q != process_id:
            chosen.add(q)
    return sorted(chosen)


def pairs_probed(num_processes: int, *, all_pairs_max: int = ALL_PAIRS_MAX, sample: int = SAMPLE) -> int:
    """How many directed pairs a job of ``num_processes`` probes in all."""
    if num_processes <= all_pairs_max:
        return num_processes * (num_processes - 1)
    return num_processes * min(num_processes - 1, 2 + sample)


def probe(source: int, target: Process, timeout: float, auth_key: bytes | None = None,
          source_host: str | None = None) -> str | None:
    """Connects to ``target``'s transfer endpoint and says HELLO; None if it answered, else why not.

    With the cluster's token (``auth_key``), the endpoint challenges the connection and the probe answers as a
    transfer would, so the peer is known to be an ifrt endpoint of this cluster, not merely an open port. Without
    one, it connects from ``source_host`` (this process's endpoint host), where the peer expects process ``source``.
    """
    try:
        with connect(target.address, timeout, source_host) as sock:
            sock.settimeout(timeout)
            sock.sendall(encode_header(HELLO, 0, source, target.process_id))
            if auth_key is not None:  # the token handshake of authenticated jobs
                challenge = b""
                while len(challenge) < CHALLENGE_BYTES:
                    got = sock.recv(CHALLENGE_BYTES - len(challenge))
                    if not got:
                        return "the endpoint closed the connection before its token challenge"
                    challenge += got
                sock.sendall(token_proof(auth_key, challenge))
            sock.shutdown(socket.SHUT_WR)
    except TimeoutError:
        return f"no answer within {timeout:g}s (packets dropped: a firewall, or no route)"
    except ConnectionRefusedError:
        return "connection refused (nothing listens there, or a firewall rejects it)"
    except (OSError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def probe_peers(topology: Topology, targets: list[int], timeout: float, auth_key: bytes | None = None,
                parallel: int = DEFAULTS.preflight_parallel) -> dict[int, str]:
    """Probes ``targets`` (process ids) at once, at most ``parallel`` at a time; {process id: why it failed}."""
    me = topology.process_id
    own = None if auth_key is not None else split_host_port(topology.process(me).address)[0] or None
    reachable = [topology.process(q) for q in targets if topology.process(q).address]
    if not reachable:
        return {}
    with ThreadPoolExecutor(max_workers=min(parallel, len(reachable)), thread_name_prefix="ifrt-preflight") as pool:
        results = list(pool.map(lambda p: (p.process_id, probe(me, p, timeout, auth_key, own)), reachable))
    return {q: error for q, error in results if error is not None}


_runs: weakref.WeakKeyDictionary[Gathering, int] = weakref.WeakKeyDictionary()
_runs_lock = threading.Lock()


def _next_run(through: Gathering) -> int:
    with _runs_lock:
        n = _runs[through] = _runs.get(through, 0) + 1
        return n


def run(through: Gathering, topology: Topology, timeout: float = DEFAULTS.preflight_timeout_s, *,
        auth_key: bytes | None = None, probe_timeout: float = DEFAULTS.preflight_probe_timeout_s,
        parallel: int = DEFAULTS.preflight_parallel, attempt: str | None = None) -> PreflightReport:
    """Probes this process's peers in ``topology``, gathers every process's failures ``through`` the coordinator,
    returns the report. ``auth_key``: the cluster's token, when the job runs with one.

    Every process of the job must call it (the barrier waits for all). Raises BarrierTimeout naming the processes
    that did not get there within ``timeout`` seconds, BarrierFailed when one of them failed meanwhile.
    """
    if not timeout > 0:
        raise InvalidArgument(f"pre-flight timeout={timeout!r} is not positive: expected seconds > 0")
    start = time.monotonic()
    deadline = start + timeout
    me, n = topology.process_id, topology.num_processes
    tag = attempt if attempt is not None else f"r{_next_run(through)}"
    prefix = f"{KEY_ROOT}/g{topology.generation}/{topology.fingerprint[:16]}/{tag}"
    targets = peers(me, n, topology.fingerprint)
    failed = probe_peers(topology, targets, min(probe_timeout, max(0.1, timeout / 4)), auth_key, parallel)
    if failed:
        log.warning("pre-flight: process %d cannot reach processes %s", me, sorted(failed))
        through.kv_set(f"{prefix}/failed/{me}", json.dumps(sorted(failed.items())).encode(), allow_overwrite=True,
                      timeout=max(0.1, deadline - time.monotonic()))
    through.barrier(prefix, timeout=max(0.1, deadline - time.monotonic()))
    found = through.kv_dir(f"{prefix}/failed/", timeout=max(0.1, deadline - time.monotonic()))
    return PreflightReport(
        generation=topology.generation, fingerprint=topology.fingerprint, num_processes=n,
        pairs_probed=pairs_probed(n), all_pairs=n <= ALL_PAIRS_MAX,
        unreachable=_unreachable(topology, found),
        without_endpoint=tuple(p.process_id for p in topology.processes if not p.address),
        seconds=time.monotonic() - start)


def _unreachable(topology: Topology, found: Mapping[str, bytes]) -> tuple[Unreachable, ...]:
    pairs = []
    for key, value in found.items():
        source = topology.process(int(key.rsplit("/", 1)[1]))
        for target, error in json.loads(value):
            pairs.append(Unreachable(source, topology.process(int(target)), str(error)))
    return tuple(sorted(pairs, key=lambda u: (u.source.process_id, u.target.process_id)))


def passed(report: PreflightReport) -> PreflightReport:
    """``report`` (logged) when every pair is reachable, else PreflightFailed naming every unreachable pair: what
    discover() does with its pre-flight under ``IFRT_PREFLIGHT=1``."""
    if not report.ok:
        raise PreflightFailed(report.describe(), report)
    log.info("%s", report.describe())
    return report
