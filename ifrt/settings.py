"""Where discover() gets its settings, in this order: explicit arguments, ``IFRT_*`` environment variables,
then the launcher's environment (torchrun, Open MPI, SLURM, Kubernetes: see ``ifrt.clusters``).

An ``IFRT_*`` variable that contradicts the launcher's (``IFRT_PROCESS_ID=3`` under torchrun's ``RANK=5``) is
an error naming both, not a silent choice; an explicit argument always wins.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypedDict, Unpack

from ifrt import clusters, network_sources
from ifrt.errors import InvalidArgument
from ifrt.hostport import split_host_port
from ifrt.protocol import read_secret_file

log = logging.getLogger("ifrt.settings")

COORDINATOR_ENV = "IFRT_COORDINATOR"  # "host:8476" or "c1:8476,c2:8477"
PROCESS_ID_ENV = "IFRT_PROCESS_ID"  # "2"; unset: the coordinator assigns ids
NUM_PROCESSES_ENV = "IFRT_NUM_PROCESSES"  # "4"; unset: take the coordinator's
PLUGIN_ENV = "IFRT_PLUGIN"  # "cpu" (default)
LOCAL_RANK_ENV = "IFRT_LOCAL_RANK"  # "0"; orders processes of one host when ids are assigned
LOCAL_WORLD_SIZE_ENV = "IFRT_LOCAL_WORLD_SIZE"  # "8"; processes on this host (plugins split devices by it)
CLUSTER_ID_ENV = "IFRT_CLUSTER_ID"  # unset: join whatever cluster the coordinator serves
TRANSFER_BIND_ENV = "IFRT_TRANSFER_BIND"  # "0.0.0.0:9000"; unset: an ephemeral port on this host's address
TRANSFER_FDS_ENV = "IFRT_TRANSFER_FDS"  # "127.0.0.1:34911=5": `ifrt run`'s listening sockets a worker adopts
TOKEN_ENV = "IFRT_TOKEN"  # the cluster's shared secret itself (prefer IFRT_TOKEN_FILE: environments leak)
TOKEN_FILE_ENV = "IFRT_TOKEN_FILE"  # "/run/secrets/ifrt-token": a file holding the token
TLS_CA_ENV = "IFRT_TLS_CA"  # "/etc/ifrt/ca.pem": trust the coordinator's certificate through this CA (turns TLS on)
TLS_CERT_ENV = "IFRT_TLS_CERT"  # "/etc/ifrt/client.pem": this process's certificate, for mutual TLS
TLS_KEY_ENV = "IFRT_TLS_KEY"  # "/etc/ifrt/client-key.pem": its private key
ATTEMPT_ENV = "IFRT_ATTEMPT"  # "2": the job attempt (else the launcher's restart counter; unset: the coordinator's)
PREEMPTION_SIGNALS_ENV = "IFRT_PREEMPTION_SIGNALS"  # "TERM" or "TERM,USR1": signals that announce a preemption
USE_PROXY_ENV = "IFRT_USE_PROXY"  # "1": dial the coordinator through http_proxy/https_proxy/grpc_proxy
PROXY_VARIABLES = ("grpc_proxy", "https_proxy", "http_proxy")
"""What gRPC reads to route a channel through a proxy (ifrt's channels ignore them unless IFRT_USE_PROXY=1)."""
PREFLIGHT_ENV = "IFRT_PREFLIGHT"  # "1": discover() runs the pre-flight before it returns
PREFLIGHT_TIMEOUT_ENV = "IFRT_PREFLIGHT_TIMEOUT"  # "60": seconds the whole check may take under IFRT_PREFLIGHT=1
NETWORK_NODES_ENV = network_sources.NETWORK_NODES_ENV  # "spine1,block2,rack7": this host's network position
NODE_LABELS_FILE_ENV = network_sources.NODE_LABELS_FILE_ENV  # "/etc/ifrt/node-labels": the node's labels, key=value
FAILOVER_WINDOW_ENV = "IFRT_FAILOVER_WINDOW"  # "30": seconds a started runtime waits for a coordinator to answer
DISCOVERY_TIMEOUT_ENV = "IFRT_DISCOVERY_TIMEOUT"  # "600": seconds discover() waits (default 300); `ifrt run` waits
# this long for a coordinator that is not up yet (default: the failover window)
AGENT_SOCKET_ENV = "IFRT_AGENT_SOCKET"  # set by `ifrt run`: its local socket, where the worker registers and holds
# its session (unset: with the coordinator itself)
SESSION_GATE_ENV = "IFRT_TEST_SESSION_GATE"
"""For tests: the path of a file; while it does not exist, the session does not open (nor reopen), so a test can make
events happen before a process attaches, without timing."""

DEFAULT_PLUGIN = "cpu"
DISCOVER_TIMEOUT_S = 300.0
"""How long ``discover()`` waits by default for every process to register (a large job starts slowly)."""


class DiscoverOptions(TypedDict, total=False):
    """The keyword arguments of ``ifrt.discover``, ``ifrt.jax.initialize``, ``ifrt.torch.init_process_group`` and
    ``ifrt.Client``; each one not given falls back to its ``IFRT_*`` variable, then to the launcher's environment.

    - ``process_id``: this process's id (``IFRT_PROCESS_ID``; unset: the coordinator assigns ids)
    - ``num_processes``: the job's process count (``IFRT_NUM_PROCESSES``; unset: take the coordinator's)
    - ``plugin``: the device plugin (``IFRT_PLUGIN``; default ``cpu``)
    - ``local_device_ids``: which of the plugin's devices this process owns (default: all it lists)
    - ``timeout``: seconds to wait for every process to register (``IFRT_DISCOVERY_TIMEOUT``; default
      ``DISCOVER_TIMEOUT_S``, 300)
    - ``token``: the cluster's shared secret (else ``IFRT_TOKEN_FILE``, then ``IFRT_TOKEN``)
    - ``network``: where this host sits in the network, root (spine) to leaf (rack), as names or one comma-separated
      string (else ``IFRT_NETWORK_NODES``, XLA's, Slurm's or the node's labels: ``ifrt.network_sources``)
    """

    process_id: int | None
    num_processes: int | None
    plugin: str | None
    local_device_ids: Sequence[int] | None
    timeout: float
    token: str | None
    network: Sequence[str] | str | None


class ProcessOptions(DiscoverOptions, total=False):
    """What ``ifrt.Client`` (and ``resolve``) take besides the discover options; each falls back to its ``IFRT_*``
    variable (``IFRT_LOCAL_RANK``, ``IFRT_CLUSTER_ID``, ``IFRT_TRANSFER_BIND``, ``IFRT_TOKEN_FILE``, ``IFRT_TLS_*``,
    ``IFRT_ATTEMPT``, ``IFRT_PREEMPTION_SIGNALS``, ``IFRT_USE_PROXY``) in ``environ`` (default: the process's)."""

    local_rank: int | None
    cluster_id: str | None
    transfer_bind: str | None
    token_file: str | None
    tls_ca: str | None
    tls_cert: str | None
    tls_key: str | None
    attempt: int | None
    preemption_signals: Sequence[int | str] | None
    use_proxy: bool | None
    environ: Mapping[str, str] | None


@dataclass(frozen=True)
class Settings:
    """Everything one process needs to register, resolved and checked."""

    coordinators: tuple[str, ...]
    process_id: int | None
    num_processes: int | None
    plugin: str
    local_device_ids: tuple[int, ...] | None
    timeout: float
    local_rank: int
    local_world_size: int
    cluster_id: str
    hostname: str
    transfer_bind: str | None = None
    """Where this process's transfer endpoint listens (None: an ephemeral port on the host's address)."""
    launcher: str | None = None
    """The launcher environment values were taken from (e.g. "slurm"), if any."""
    token: str | None = field(default=None, repr=False)
    """The cluster's shared secret, sent on every call (never printed or logged)."""
    tls_ca: str | None = None
    """PEM file of the CA that signed the coordinator's certificate; set (or tls_cert) means TLS."""
    tls_cert: str | None = None
    tls_key: str | None = None
    attempt: int | None = None
    """The job attempt this process belongs to (None: whatever the coordinator serves)."""
    preemption_signals: tuple[signal.Signals, ...] = ()
    """Signals that announce this process's preemption (reported, not fatal; see reached_preemption_sync_point)."""
    use_proxy: bool = False
    """Whether the coordinator is dialled through the proxy the environment names (by default: directly)."""
    slice_index: int | None = None
    """The slice the launcher placed this host in (TPU multislice); the slice key of devices whose plugin gives none."""
    network: tuple[str, ...] = ()
    """Where this host sits in the network, root to leaf (empty: no source gave a position)."""
    network_source: str = ""
    """Where ``network`` came from (``IFRT_NETWORK_NODES``, ...; empty where nothing did)."""
    network_conflicts: tuple[str, ...] = ()
    """Later sources that give another path or cannot be read (``ifrt.network_sources.Position.conflicts``)."""
    accelerator_domain: str = ""
    """The NVLink partition the node's labels name (``IFRT_NODE_LABELS_FILE``; empty where none does)."""
    agent_socket: str | None = None
    """The Unix socket of this host's ``ifrt run`` agent: Register and Session go there (None: to the coordinator)."""

    @property
    def tls(self) -> bool:
        return bool(self.tls_ca or self.tls_cert)


def parse_coordinators(value: str) -> tuple[str, ...]:
    """``"c1:8476, c2:8477"`` -> ``("c1:8476", "c2:8477")``; InvalidArgument if an entry is not host:port."""
    addresses = tuple(a.strip() for a in value.split(",") if a.strip())
    if not addresses:
        raise InvalidArgument(f"no coordinator address given: pass coordinator= (--coordinator on the command "
                              f"line), set {COORDINATOR_ENV}=HOST:PORT, or "
                              f"run under a launcher that names one (looked for: "
                              f"{', '.join(d.name for d in clusters.DETECTORS)}; none found)")
    for a in addresses:
        host, port = split_host_port(a)
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidArgument(f"coordinator address {a!r} is not HOST:PORT with a port from 1 to 65535")
    return addresses


def _int_from(name: str, value: object, minimum: int) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    else:
        try:
            number = int(str(value).strip(), 10)
        except ValueError:
            raise InvalidArgument(f"{name}={value!r} is not an integer") from None
    if number < minimum:
        raise InvalidArgument(f"{name}={number} is out of range: expected >= {minimum}")
    return number


def resolve(coordinator: str | Sequence[str] | None = None, **options: Unpack[ProcessOptions]) -> Settings:
    """The settings for one process (``options``: see ProcessOptions); InvalidArgument naming the variable or
    argument that is wrong, TypeError for an argument it does not take."""
    unknown = sorted(options.keys() - ProcessOptions.__optional_keys__)
    if unknown:
        raise TypeError(f"unexpected keyword argument {unknown[0]!r} (the options are "
                        f"{', '.join(sorted(ProcessOptions.__optional_keys__))})")
    process_id, num_processes = options.get("process_id"), options.get("num_processes")
    plugin, local_device_ids = options.get("plugin"), options.get("local_device_ids")
    token = options.get("token")
    tls_ca, tls_cert, tls_key = options.get("tls_ca"), options.get("tls_cert"), options.get("tls_key")
    attempt, cluster_id, local_rank = options.get("attempt"), options.get("cluster_id"), options.get("local_rank")
    environ = options.get("environ")
    env = os.environ if environ is None else environ
    launcher = clusters.detect(env)
    timeout = options.get("timeout")
    timeout = discovery_timeout(env) if timeout is None else timeout

    def pick(value: object, var: str, name: str, minimum: int) -> int | None:
        if value is not None:
            return _int_from(name, value, minimum)
        raw = env.get(var, "").strip()
        found = None if launcher is None else getattr(launcher, name)
        if not raw:
            return found
        number = _int_from(var, raw, minimum)
        if found is not None and found != number:
            raise InvalidArgument(f"{var}={number} contradicts the {launcher.source} environment's "  # type: ignore
                                  f"{launcher.origin(name)}: unset one of them, or pass {name}= explicitly")
        return number

    if coordinator is None:
        raw = env.get(COORDINATOR_ENV, "")
        if not raw.strip() and launcher is not None and launcher.coordinator:
            raw = launcher.coordinator
        coordinators = parse_coordinators(raw)
    elif isinstance(coordinator, str):
        coordinators = parse_coordinators(coordinator)
    else:
        coordinators = parse_coordinators(",".join(coordinator))
    pid = pick(process_id, PROCESS_ID_ENV, "process_id", 0)
    count = pick(num_processes, NUM_PROCESSES_ENV, "num_processes", 1)
    if pid is not None and count is not None and pid >= count:
        raise InvalidArgument(f"process id {pid} is out of range: expected 0 <= process_id < num_processes ({count})")
    if not timeout > 0:
        raise InvalidArgument(f"timeout={timeout!r} is not positive: expected seconds > 0")
    if launcher is not None:
        log.info("launcher environment: %s (%s)", launcher.source, ", ".join(launcher.variables))
    tls = {name: _readable(value or env.get(var, "").strip() or None, name if value else var)
           for name, value, var in (("tls_ca", tls_ca, TLS_CA_ENV), ("tls_cert", tls_cert, TLS_CERT_ENV),
                                    ("tls_key", tls_key, TLS_KEY_ENV))}
    if bool(tls["tls_cert"]) != bool(tls["tls_key"]):
        raise InvalidArgument(f"a client certificate needs its key and a key its certificate: set both {TLS_CERT_ENV} "
                              f"and {TLS_KEY_ENV}, or neither")
    position = network_position(options.get("network"), env)
    return Settings(
        coordinators=coordinators,
        process_id=pid,
        num_processes=count,
        plugin=plugin or env.get(PLUGIN_ENV, "").strip() or DEFAULT_PLUGIN,
        local_device_ids=None if local_device_ids is None else tuple(int(i) for i in local_device_ids),
        timeout=float(timeout),
        local_rank=pick(local_rank, LOCAL_RANK_ENV, "local_rank", 0) or 0,
        local_world_size=pick(None, LOCAL_WORLD_SIZE_ENV, "local_world_size", 1) or 1,
        cluster_id=cluster_id if cluster_id is not None else env.get(CLUSTER_ID_ENV, "").strip(),
        hostname=socket.gethostname(),
        transfer_bind=options.get("transfer_bind") or env.get(TRANSFER_BIND_ENV, "").strip() or None,
        launcher=None if launcher is None else launcher.source,
        token=_token(token, options.get("token_file"), env),
        **tls,
        attempt=pick(attempt, ATTEMPT_ENV, "attempt", 0),
        preemption_signals=_signals(options.get("preemption_signals"), env),
        use_proxy=_use_proxy(options.get("use_proxy"), env),
        slice_index=None if launcher is None else launcher.slice_index,
        network=position.path,
        network_source=position.source,
        network_conflicts=position.conflicts,
        accelerator_domain=position.accelerator,
        agent_socket=env.get(AGENT_SOCKET_ENV, "").strip() or None,
    )


def network_position(given: Sequence[str] | str | None = None,
                     environ: Mapping[str, str] | None = None) -> network_sources.Position:
    """This host's network position and its source (``ifrt.network_sources.choose``), reading the labels file
    ``IFRT_NODE_LABELS_FILE`` names; InvalidArgument naming the path if it cannot be read."""
    env = os.environ if environ is None else environ
    path = env.get(NODE_LABELS_FILE_ENV, "").strip()
    text = None
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read(1 << 20)
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidArgument(f"{NODE_LABELS_FILE_ENV}={path!r} cannot be read ({e.strerror or e}): expected a "
                                  "file of the node's labels, one key=value a line") from None
    position = network_sources.choose(given, env, text)
    network_sources.warn(position)
    return position


def parse_signal(value: int | str, origin: str) -> signal.Signals:
    """``"TERM"``, ``"SIGTERM"``, ``"15"`` or ``signal.SIGTERM`` -> ``signal.SIGTERM``; InvalidArgument naming it."""
    text = str(value).strip().upper()
    try:
        return signal.Signals(int(text)) if text.isdigit() else signal.Signals[text if text.startswith("SIG")
                                                                                else f"SIG{text}"]
    except (KeyError, ValueError):
        raise InvalidArgument(f"{origin}: {value!r} is not a signal: expected a name such as TERM or USR1, or a "
                              "number") from None


def _signals(given: Sequence[int | str] | None, env: Mapping[str, str]) -> tuple[signal.Signals, ...]:
    if given is not None:
        return tuple(parse_signal(s, "preemption_signals=") for s in given)
    raw = env.get(PREEMPTION_SIGNALS_ENV, "")
    return tuple(parse_signal(s, PREEMPTION_SIGNALS_ENV) for s in raw.split(",") if s.strip())


def _use_proxy(given: bool | None, env: Mapping[str, str]) -> bool:
    if given is not None:
        return bool(given)
    raw = env.get(USE_PROXY_ENV, "").strip().lower()
    if raw in ("", "0", "false", "no"):
        return False
    if raw in ("1", "true", "yes"):
        return True
    raise InvalidArgument(f"{USE_PROXY_ENV}={raw!r} is malformed: expected 1 (go through the proxy) or 0 (dial "
                          "the coordinator directly, the default)")


def proxies_set(environ: Mapping[str, str] | None = None) -> list[str]:
    """The proxy variables gRPC would follow that are set here, e.g. ``["https_proxy=http://proxy:3128"]``."""
    env = os.environ if environ is None else environ
    return [f"{var}={env[var]}" for var in PROXY_VARIABLES if env.get(var, "").strip()]


def own_variables(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``IFRT_*`` variables alone: what a caller that is no job process (torchrun's agent) may take."""
    return {k: v for k, v in (os.environ if environ is None else environ).items() if k.startswith("IFRT_")}


def present_launchers(environ: Mapping[str, str] | None = None) -> list[clusters.Detected]:
    """Every launcher whose environment is present here, highest priority first (for diagnostics)."""
    return clusters.present(os.environ if environ is None else environ)


def _token(token: str | None, token_file: str | None, env: Mapping[str, str]) -> str | None:
    """The token from the argument, the file argument, IFRT_TOKEN, then IFRT_TOKEN_FILE; errors never show it."""
    if token is not None:
        value, origin = token, "token="
    elif token_file is not None:
        value, origin = read_secret_file(token_file, "token_file="), "token_file="
    elif env.get(TOKEN_ENV):
        value, origin = env[TOKEN_ENV], TOKEN_ENV
    elif env.get(TOKEN_FILE_ENV, "").strip():
        value, origin = read_secret_file(env[TOKEN_FILE_ENV].strip(), TOKEN_FILE_ENV), TOKEN_FILE_ENV
    else:
        return None
    value = value.strip()
    if not value:
        raise InvalidArgument(f"the token from {origin} is empty: expected the cluster's shared secret")
    return value


def _readable(path: str | None, origin: str) -> str | None:
    """``path`` if it names a readable file; InvalidArgument naming the setting otherwise."""
    if path is not None and not os.access(path, os.R_OK):
        raise InvalidArgument(f"{origin}={path!r} is not a readable file")
    return path


def env_plugin(environ: Mapping[str, str] | None = None) -> str | None:
    """The device plugin ``IFRT_PLUGIN`` names (``"cpu"``), or None when it is unset."""
    env = os.environ if environ is None else environ
    return env.get(PLUGIN_ENV, "").strip() or None


def preflight_timeout(default: float, environ: Mapping[str, str] | None = None) -> float | None:
    """The seconds discover()'s pre-flight may take when ``IFRT_PREFLIGHT=1`` asks for one (``IFRT_PREFLIGHT_TIMEOUT``,
    else ``default``), or None when none is asked for; InvalidArgument naming a timeout that is not a number."""
    env = os.environ if environ is None else environ
    if env.get(PREFLIGHT_ENV, "").strip().lower() not in ("1", "true", "yes", "on"):
        return None
    raw = env.get(PREFLIGHT_TIMEOUT_ENV, "").strip()
    try:
        return float(raw) if raw else default
    except ValueError:
        raise InvalidArgument(f"{PREFLIGHT_TIMEOUT_ENV}={raw!r} is not a number of seconds") from None


def failover_window(default: float, environ: Mapping[str, str] | None = None) -> float:
    """``IFRT_FAILOVER_WINDOW`` in seconds, else ``default``; InvalidArgument naming the value if it is not a
    positive number."""
    raw = (os.environ if environ is None else environ).get(FAILOVER_WINDOW_ENV, "").strip()
    if not raw:
        return default
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0 or seconds == float("inf"):
        raise InvalidArgument(f"{FAILOVER_WINDOW_ENV}={raw!r}: expected a positive number of seconds, e.g. "
                              f"{default:g}")
    return seconds


def discovery_timeout(environ: Mapping[str, str] | None = None, default: float = DISCOVER_TIMEOUT_S) -> float:
    """``IFRT_DISCOVERY_TIMEOUT`` in seconds, else ``default``: how long discover() waits when no timeout is passed;
    InvalidArgument naming the value if it is not a positive number."""
    raw = (os.environ if environ is None else environ).get(DISCOVERY_TIMEOUT_ENV, "").strip()
    return default if not raw else _seconds(DISCOVERY_TIMEOUT_ENV, raw, default)


def _seconds(name: str, raw: str, example: float) -> float:
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0 or seconds == float("inf"):
        raise InvalidArgument(f"{name}={raw!r} is out of range: expected a positive number of seconds, e.g. "
                              f"{example:g}")
    return seconds


def session_gate(environ: Mapping[str, str] | None = None) -> str:
    """The file ``IFRT_TEST_SESSION_GATE`` names (tests only: no session opens while it is missing), or ""."""
    env = os.environ if environ is None else environ
    return env.get(SESSION_GATE_ENV, "")
