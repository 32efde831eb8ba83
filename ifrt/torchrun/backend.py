"""torchrun's ``--rdzv-backend ifrt``: torch elastic's dynamic rendezvous, its state on ifrt's coordinator.

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend ifrt --rdzv-endpoint c1:8476,c2:8476 train.py

The agents meet through torch's own ``DynamicRendezvousHandler`` (``--nnodes MIN:MAX``, last call, heartbeats,
re-rendezvous on a failure or a new node, exactly as with ``--rdzv-backend c10d``); only where its state lives
changes: one key in ifrt's key-value store, written with compare-and-set, so the rendezvous survives the loss of
any host and of a coordinator replica (the client moves on to the next replica of ``--rdzv-endpoint``). Node
ranks follow ifrt's host-aware order: network position (``IFRT_NETWORK_NODES`` or another source, level by level), then
hostname in natural order (``node2`` before ``node10``), then host address as a number, like the process ids the
coordinator assigns, so consecutive node ranks share the smallest rack or block. Registered in the entry-point
group ``torchrun.handlers`` (see pyproject.toml).
"""

from __future__ import annotations

import ipaddress
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    RendezvousTimeout,
    Token,
)

from ifrt.client import Client
from ifrt.clusters.base import DEFAULT_PORT
from ifrt.errors import IfrtError, InvalidArgument
from ifrt.local_address import local_address_toward
from ifrt.network import check_path, natural_key, path_key
from ifrt.settings import COORDINATOR_ENV, network_position, own_variables, parse_coordinators
from ifrt.torch.store import Store
from ifrt.torchrun.state import CheckedStateBackend

BACKEND = "ifrt"
KEY_PREFIX = "torchrun/"
"""Every key the agents use starts with this (the coordinator lets agents, which are no processes of the
topology, use these keys only)."""
READ_TIMEOUT_S = 60
"""Default of ``--rdzv-conf read_timeout``: how long one call may take, a coordinator failover included."""
TIMEOUTS = ("join", "last_call", "close", "heartbeat")
"""torch's ``--rdzv-conf <step>_timeout`` options, in RendezvousTimeout's order."""


def handler_creator() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The ``torchrun.handlers`` entry point: torchrun calls it and registers what it returns as ``ifrt``."""
    return create_rendezvous_handler


def create_rendezvous_handler(params: RendezvousParameters) -> IfrtRendezvousHandler:
    """A handler for ``params`` (``--rdzv-endpoint``, ``--rdzv-id``, ``--nnodes``, ``--rdzv-conf``).

    ``--rdzv-conf`` takes torch's dynamic rendezvous options (join_timeout, last_call_timeout, close_timeout,
    heartbeat_timeout, keep_alive_interval, keep_alive_max_attempt) and ``read_timeout`` (seconds one call to the
    coordinator may take, failover included). The coordinator's token and TLS come from ``IFRT_*`` as for any
    process. Workers inherit ``IFRT_COORDINATOR`` (the endpoint's replicas) unless it is set.
    """
    coordinators = endpoint_replicas(params.endpoint)
    read_timeout = _positive(params, "read_timeout", READ_TIMEOUT_S)
    timeouts = RendezvousTimeout(*(_seconds(params, f"{step}_timeout") for step in TIMEOUTS))
    keep_alive_interval = _positive(params, "keep_alive_interval", 5)
    keep_alive_max_attempt = _positive(params, "keep_alive_max_attempt", 3)
    # Only IFRT_* settings (token, TLS): the launcher's own variables describe workers, not this agent.
    client = Client(coordinators, session=False, transfer=False, environ=own_variables())
    os.environ.setdefault(COORDINATOR_ENV, ",".join(coordinators))  # workers start from the same replicas
    prefix = f"{KEY_PREFIX}{params.run_id}/"
    store = Store(client, prefix=f"{prefix}store/", timeout=float(read_timeout))
    backend = IfrtRendezvousBackend(client, f"{prefix}state", timeout=read_timeout)
    # torch's state holder unpickles what its backend returns: it reads through the check, never the stored bytes.
    checked = CheckedStateBackend(backend, backend.key, params.max_nodes)
    handler = IfrtRendezvousHandler.from_backend(
        params.run_id, store, checked, params.min_nodes, params.max_nodes, params.local_addr, timeouts,
        keep_alive_interval=keep_alive_interval, keep_alive_max_attempt=keep_alive_max_attempt)
    host = HostKey(client.settings.hostname, params.local_addr or local_address_toward(coordinators),
                   agent_position(os.environ))
    handler.hosts = NodeHosts(client, f"{prefix}hosts/", host, read_timeout)
    return handler


def _seconds(params: RendezvousParameters, key: str) -> timedelta | None:
    return None if params.get(key) is None else timedelta(seconds=_positive(params, key, 0))


def _positive(params: RendezvousParameters, key: str, default: int) -> int:
    try:
        value = params.get_as_int(key, default)
    except ValueError:
        value = None
    if value is None or value <= 0:
        raise InvalidArgument(f"--rdzv-conf {key}={params.get(key)!r}: expected a positive integer")
    return value


def endpoint_replicas(endpoint: str) -> tuple[str, ...]:
    """``"c1,c2:9000"`` -> ``("c1:8476", "c2:9000")``: the coordinator replicas, ifrt's port where none is given."""
    entries = [e.strip() for e in endpoint.split(",") if e.strip()]
    if not entries:
        raise InvalidArgument("--rdzv-endpoint is empty: expected the coordinator as HOST[:PORT], or its replicas "
                              "comma-separated (c1:8476,c2:8476)")
    with_ports = []
    for e in entries:
        if e.count(":") > 1 and not e.startswith("["):  # a bare IPv6 address: no port
            e = f"[{e}]"
        host, sep, port = e.rpartition(":")
        with_ports.append(e if sep and port.isdigit() and not host.endswith(":") else f"{e}:{DEFAULT_PORT}")
    return parse_coordinators(",".join(with_ports))


class IfrtRendezvousBackend(RendezvousBackend):
    """The rendezvous state as one key-value of ifrt's coordinator: opaque bytes, as torch's backend contract says,
    fenced by a token that is the stored value itself (compare-and-set, as torch's c10d backend does).

    Any token holder can write the key, so torch's state holder reads through ``ifrt.torchrun.state``'s
    ``CheckedStateBackend``, never this backend alone (``create_rendezvous_handler``). An empty value reads as no
    state (compare-and-set cannot tell it from none). Each call retries across the coordinator's replicas for up to
    ``timeout`` seconds; then RendezvousConnectionError, wrapping ifrt's error."""

    def __init__(self, client: Client, key: str, timeout: float = READ_TIMEOUT_S) -> None:
        self._client, self._key, self._timeout = client, key, timeout

    @property
    def key(self) -> str:
        """The key the state is stored at."""
        return self._key

    @property
    def name(self) -> str:
        return BACKEND

    def get_state(self) -> tuple[bytes, Token] | None:
        """The stored bytes and their token, None before any agent wrote one."""
        value = self._call(self._client.kv_try_get, self._key, timeout=self._timeout)
        return (value, value) if value else None

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        """Writes ``state`` if the stored one is still ``token`` (None: if there is none); returns what is stored
        now, its token and whether it is ours."""
        if token is not None and not isinstance(token, bytes):  # not a token of ours: it cannot match
            current = self.get_state()
            return None if current is None else (*current, False)
        expected = token or b""
        stored = self._call(self._client.kv_compare_set, self._key, expected, state, timeout=self._timeout)
        if stored == state:
            return state, state, True
        if not stored or stored == expected:  # the key is gone (compare_set answers nothing, or echoes): read it
            current = self.get_state()
            return None if current is None else (*current, False)
        return stored, stored, False

    def _call(self, method: Callable[..., Any], *args: object, **kwargs: object) -> Any:
        try:
            return method(*args, **kwargs)
        except IfrtError as e:
            raise RendezvousConnectionError(f"the rendezvous state {self._key!r} on ifrt's coordinator "
                                            f"({', '.join(self._client.settings.coordinators)}): {e}") from e


def agent_position(environ: Mapping[str, str]) -> tuple[str, ...]:
    """Where this agent's host sits in the network, from the sources its workers read (``IFRT_NETWORK_NODES``,
    XLA's variable, Slurm's topology address, the node labels file: ``ifrt.settings.network_position``), so an
    agent and its workers agree; empty where none gives one; InvalidArgument naming the source of a bad one."""
    return network_position(None, environ).path


@dataclass(frozen=True)
class HostKey:
    """Where an agent runs: its hostname (as ifrt registers it), its host address and its network position."""

    hostname: str
    address: str
    network: tuple[str, ...] = ()

    def order(self) -> tuple:
        """ifrt's host order: network path (level by level), hostname (both in natural order), then the address as a
        number (10.0.0.9 before 10.0.0.10, IPv4 before IPv6), then any other address text."""
        first = path_key(self.network), natural_key(self.hostname)
        try:
            ip = ipaddress.ip_address(self.address)
        except ValueError:
            return *first, 7, 0, self.address
        return *first, ip.version, int(ip), self.address


def node_ranks(participants: Mapping[str, HostKey]) -> dict[str, int]:
    """Node rank of each participant (by its node name): hosts in ifrt's order, ties by the name."""
    ordered = sorted(participants, key=lambda node: (participants[node].order(), node))
    return {node: rank for rank, node in enumerate(ordered)}


class NodeHosts:
    """Which host each agent of the rendezvous runs on, as key-values under ``prefix`` (one per node)."""

    def __init__(self, client: Client, prefix: str, host: HostKey, timeout: float) -> None:
        self.client, self.prefix, self.host, self.timeout = client, prefix, host, timeout

    def publish(self, node: str) -> None:
        """Records this agent's host for ``node`` (its name in the rendezvous) before it joins a round."""
        entry: dict[str, Any] = {"hostname": self.host.hostname, "address": self.host.address}
        if self.host.network:
            entry["network"] = list(self.host.network)
        value = json.dumps(entry).encode()
        try:
            self.client.kv_set(self.prefix + node, value, allow_overwrite=True, timeout=self.timeout)
        except IfrtError as e:
            raise RendezvousConnectionError(f"could not publish this node's host on ifrt's coordinator: {e}") from e

    def ranks(self, nodes: list[str]) -> dict[str, int]:
        """The node rank of each of ``nodes``, all of which published their host."""
        try:
            published = self.client.kv_dir(self.prefix, timeout=self.timeout)
        except IfrtError as e:
            raise RendezvousConnectionError(f"could not read the nodes' hosts from ifrt's coordinator: {e}") from e
        hosts = {}
        for node in nodes:
            raw = published.get(self.prefix + node)
            if raw is None:
                raise RendezvousStateError(f"node {node} joined the rendezvous without publishing its host under "
                                           f"{self.prefix!r}")
            hosts[node] = host_entry(self.prefix + node, raw)
        return node_ranks(hosts)


def host_entry(key: str, raw: bytes) -> HostKey:
    """The host an agent published at ``key``; RendezvousStateError naming the key for anything but the JSON object
    ``publish`` writes."""
    try:
        entry = json.loads(raw)
    except (ValueError, RecursionError):  # not JSON (UnicodeDecodeError included), or nested past the limit
        entry = None
    network = entry.get("network", []) if isinstance(entry, dict) else None
    if not (isinstance(entry, dict) and set(entry) - {"network"} == {"hostname", "address"}
            and isinstance(entry["hostname"], str) and isinstance(entry["address"], str)
            and isinstance(network, list) and all(isinstance(level, str) for level in network)):
        raise RendezvousStateError(f"refused the node's host at {key!r} on ifrt's coordinator: expected "
                                   f'{{"hostname": str, "address": str, "network": [str, ...]}} as torchrun\'s agents '
                                   f"write it, found {raw[:64]!r} ({len(raw)} bytes)")
    try:
        path = check_path(network, f"the node's network position at {key!r}")
    except InvalidArgument as e:
        raise RendezvousStateError(f"refused the node's host: {e}") from e
    return HostKey(entry["hostname"], entry["address"], path)


class IfrtRendezvousHandler(DynamicRendezvousHandler):
    """torch's dynamic rendezvous on ifrt's coordinator, node ranks in ifrt's host order."""

    hosts: NodeHosts

    def next_rendezvous(self) -> RendezvousInfo:
        """Publishes where this agent runs, then joins the next round (torch's dynamic rendezvous).

        Each round, node rank 0's agent hosts a new TCPStore for the workers (MASTER_ADDR, MASTER_PORT) and every
        agent reads where: torch's handler keeps the first round's, which outlives a lost node rank 0 and hands a
        restarted group the previous group's keys."""
        self.hosts.publish(repr(self._this_node))
        self._bootstrap_store_info = None
        self._shared_tcp_store_server = None
        return super().next_rendezvous()

    def _get_world(self) -> tuple[int, int]:
        """(this node's rank, node count) in ifrt's host order; torch's own orders by the address as text."""
        nodes = [repr(node) for node in self._state_holder.state.participants]
        return self.hosts.ranks(nodes)[repr(self._this_node)], len(nodes)

    def shutdown(self) -> bool:
        """Closes the rendezvous (torch's), then this agent's connections to the coordinator."""
        try:
            return super().shutdown()
        finally:
            self.hosts.client.close()


__all__ = ["BACKEND", "KEY_PREFIX", "HostKey", "agent_position", "IfrtRendezvousBackend", "IfrtRendezvousHandler",
           "NodeHosts", "create_rendezvous_handler", "endpoint_replicas", "handler_creator", "host_entry", "node_ranks"]
