"""``ifrt``: the process side from a shell (``ifrt discover``, ``ifrt doctor``, ``ifrt plugins``, ``ifrt env``)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from ifrt import variables, waiting
from ifrt.agent_credential import AGENT_KEY_FILE_ENV, host_credential, read_agent_key
from ifrt.errors import IfrtError
from ifrt.safe_text import safe, safe_lines
from ifrt.settings import (
    COORDINATOR_ENV,
    NUM_PROCESSES_ENV,
    PLUGIN_ENV,
    PROCESS_ID_ENV,
    present_launchers,
    proxies_set,
    resolve,
)
from plugins import all_plugins


def _job_arguments(p: argparse.ArgumentParser, transfer_help: str, timeout_help: str) -> None:
    """The settings of a job's process, shared by ``discover`` and ``doctor``."""
    p.add_argument("--coordinator", metavar="HOST:PORT[,HOST:PORT...]",
                   help=f"coordinator address(es) (default ${COORDINATOR_ENV})")
    p.add_argument("--process-id", type=int, metavar="I",
                   help=f"this process's id (default ${PROCESS_ID_ENV}; unset: the coordinator assigns one)")
    p.add_argument("--num-processes", type=int, metavar="N",
                   help=f"expected process count, checked against the coordinator's (default ${NUM_PROCESSES_ENV})")
    p.add_argument("--plugin", metavar="NAME", help=f"device plugin (default ${PLUGIN_ENV}, else cpu)")
    p.add_argument("--transfer-bind", metavar="HOST:PORT", help=transfer_help)
    p.add_argument("--token-file", metavar="PATH",
                   help="file holding the cluster's token, if the coordinator requires one (default "
                        "$IFRT_TOKEN_FILE, or $IFRT_TOKEN itself)")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS", help=timeout_help)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ifrt", description="ifrt-topology from the shell.")
    commands = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    d = commands.add_parser(
        "discover", help="register this process with the coordinator and print the published topology",
        description="Registers this process's local devices with the coordinator, waits until every process has "
                    "registered, and prints the topology. Exits non-zero, with the error on stderr, on failure.")
    _job_arguments(d, transfer_help="where this process's transfer endpoint listens, advertised in the topology "
                                    "(default $IFRT_TRANSFER_BIND, else an ephemeral port on the address that "
                                    "reaches the coordinator)",
                   timeout_help="give up after this long, naming who is missing (default "
                                "$IFRT_DISCOVERY_TIMEOUT, else 300)")
    d.add_argument("--json", action="store_true", help="print the topology as one JSON object (Topology.to_dict)")
    d.add_argument("--verbose", "-v", action="store_true", help="log progress while waiting")
    d.add_argument("--mesh", metavar="SHAPE", type=_mesh_shape,
                   help="a mesh shape such as 64x16x8: also say which level of the network each of its axes crosses")
    d.add_argument("--axes", metavar="NAMES", default=None,
                   help="the --mesh axes' names, comma-separated, outermost first (default axis0,axis1,...)")
    pl = commands.add_parser("plugins", help="list the device plugins found and whether each works here",
                             description="Lists built-in plugins and those of installed distributions (entry "
                                         "point group ifrt.plugins), whether each is available here and why not. "
                                         "A plugin that fails to load is listed with its error.")
    pl.add_argument("--json", action="store_true", help="one JSON object per plugin, one per line")
    e = commands.add_parser("env", help="show the settings discover() would use here, and where each comes from",
                            description="Shows the launcher environments found (torchrun, Open MPI, SLURM, "
                                        "Kubernetes, ...) and the settings discover() would resolve from them and "
                                        "IFRT_* variables. Exits 1 when discover() would fail here.")
    e.add_argument("--json", action="store_true",
                   help='print one JSON object: {"launchers": [...], "settings": {...}} or {"error": ...}')
    dr = commands.add_parser(
        "doctor", help="pre-flight: can every process of the job reach its peers' transfer endpoints?",
        description="Run on every host of the job at once, with the job's settings: each process registers like "
                    "`ifrt discover`, then probes its peers' transfer endpoints (every pair up to 64 processes, "
                    "above that a ring plus 8 random peers each), the results are gathered through the "
                    "coordinator, and every process prints the same report: each unreachable pair by process "
                    "id, host and address, and why. Exits 0 when every endpoint probed is reachable, 1 otherwise.")
    _job_arguments(dr, transfer_help="where this process's transfer endpoint listens: the job's own setting, so "
                                     "that the check probes what the job will use (default $IFRT_TRANSFER_BIND, "
                                     "else ephemeral)",
                   timeout_help="discovery timeout: give up after this long, naming who is missing (default "
                                "$IFRT_DISCOVERY_TIMEOUT, else 300)")
    dr.add_argument("--check-timeout", type=float, default=60.0, metavar="SECONDS",
                    help="how long the check may take once discovered, waiting for the other processes' results "
                         "(default %(default)s; one probe waits at most 2 s)")
    dr.add_argument("--json", action="store_true", help="print the report as one JSON object")
    dr.add_argument("--verbose", "-v", action="store_true", help="log progress while waiting")
    st = commands.add_parser(
        "status", help="ask the coordinator how the cluster is doing",
        description="Asks every coordinator replica at once and prints the leader's view: cluster state (waiting, "
                    "published, degraded, or standby when no replica asked leads), generation and fingerprint, "
                    "who registered and who is missing, failed processes with the reason, each process's host and "
                    "the age of its last heartbeat, and which replica leads. Exits non-zero when no replica answers.")
    st.add_argument("--coordinator", metavar="HOST:PORT[,HOST:PORT...]",
                    help=f"coordinator address(es); every replica is asked (default ${COORDINATOR_ENV})")
    st.add_argument("--json", action="store_true",
                    help="print one JSON object (keys include state, registered, expected, missing, failed, "
                         "generation, fingerprint, processes, leader, replicas)")
    st.add_argument("--watch", nargs="?", type=float, const=2.0, metavar="SECONDS",
                    help="print the status again every SECONDS (default 2) until interrupted (Ctrl-C)")
    st.add_argument("--count", type=int, metavar="N", help="with --watch: stop after N reports")
    st.add_argument("--svg", metavar="FILE",
                    help="also write the cluster's picture to FILE as SVG (hosts, their processes and devices, "
                         "failed, missing, restarting and slow ones marked; with --watch, rewritten each time)")
    st.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS",
                    help="how long to wait for the replicas' answers (default %(default)s)")
    st.add_argument("--token-file", metavar="PATH",
                    help="file holding the cluster's token (default $IFRT_TOKEN_FILE or $IFRT_TOKEN; TLS from "
                         "$IFRT_TLS_CA, $IFRT_TLS_CERT, $IFRT_TLS_KEY)")
    ac = commands.add_parser(
        "agent-credential", help="print a host's `ifrt run` credential, for the coordinator's --agent-key-file",
        description="Prints the credential an `ifrt run` agent on HOST presents (the HMAC of HOST under the agent "
                    "key): hand it to that host only (e.g. into the file its --agent-credential-file names), so its "
                    "agent can act for HOST and no other host. HOST is the agent's hostname as `ifrt env` shows it.")
    ac.add_argument("--host", required=True, metavar="HOST", help="the host the credential is for")
    ac.add_argument("--key-file", metavar="PATH", default=os.environ.get(AGENT_KEY_FILE_ENV),
                    help=f"the agent key (the coordinator's --agent-key-file; default ${AGENT_KEY_FILE_ENV})")
    from ifrt.run.flags import add_arguments as run_arguments

    run_arguments(commands.add_parser(
        "run", help="start this host's workers and restart the whole job in place when a process fails (or, with "
                    "--recover replace, only the failed process)",
        description="One agent per host: starts N workers (IFRT_LOCAL_RANK, IFRT_LOCAL_WORLD_SIZE, IFRT_ATTEMPT and "
                    "the resolved IFRT_* settings), watches them and the job, and on a failure anywhere stops them "
                    "and starts the coordinator's next attempt (--recover replace: starts only the failed worker "
                    "anew, the others keep running), up to --max-restarts. Exits 0 when every worker "
                    "exited 0; 1 when the restarts are exhausted (with every attempt's failure); 2 for bad flags or "
                    "settings; 69 when the coordinator stayed out of reach; the workers' status after SIGTERM or "
                    "SIGINT (see docs/failures.md)."))
    return p


def _agent_credential(host: str, key_file: str | None) -> int:
    if not key_file:
        print(f"ifrt agent-credential: no agent key: give --key-file or set {AGENT_KEY_FILE_ENV}", file=sys.stderr)
        return 2
    try:
        print(host_credential(read_agent_key(key_file, "--key-file"), host))
    except IfrtError as e:
        print(f"ifrt agent-credential: {safe(e)}", file=sys.stderr)
        return 2
    return 0


def _plugins(as_json: bool) -> int:
    infos = all_plugins()
    if as_json:
        for info in infos:
            print(json.dumps({"name": info.name, "source": info.source, "status": info.status}))
        return 0
    rows = [("plugin", "source", "status")] + [(i.name, i.source, i.status) for i in infos]
    widths = [max(len(r[c]) for r in rows) for c in range(2)]
    for name, source, status in rows:
        print(f"{name.ljust(widths[0])}  {source.ljust(widths[1])}  {status}")
    return 0


_LAUNCHER_FIELDS = ("coordinator", "process_id", "num_processes", "local_rank", "local_world_size", "slice_index")


def _env(as_json: bool) -> int:
    launchers = [{"source": found.source, **{f: getattr(found, f) for f in _LAUNCHER_FIELDS}}
                 for found in present_launchers()]
    unknown = variables.unknown(os.environ)
    try:
        settings = resolve()
    except IfrtError as e:
        if as_json:
            print(json.dumps({"launchers": launchers, "unknown_variables": unknown, "error": str(e)}))
        else:
            _print_unknown(unknown)
            _print_launchers(launchers)
            print(f"discover() would fail: {safe(e)}")
        return 1
    shown = {field: _shown(field, value) for field, value in vars(settings).items()}
    if as_json:
        print(json.dumps({"launchers": launchers, "settings": shown, "unknown_variables": unknown}, default=str))
        return 0
    _print_unknown(unknown)
    _print_launchers(launchers)
    for field, value in shown.items():
        if field in ("network_source", "network_conflicts"):
            continue
        if field == "network":
            value = (f"{'/'.join(settings.network)} (from {settings.network_source})" if settings.network else
                     "(none: ids follow hostnames; set IFRT_NETWORK_NODES or IFRT_NODE_LABELS_FILE, see "
                     "docs/discovery.md)")
            value = safe(value)
            for conflict in settings.network_conflicts:  # sources that disagree: said, not silently outvoted
                print(safe(f"warning: network sources disagree: {conflict}; {settings.network_source} is used"))
        if field == "cluster_id" and not value:
            value = "(not set: joins the cluster the coordinator serves, 'default' unless its --cluster-id says)"
        print(f"{field}: {value}")
    proxies = proxies_set()
    if proxies:
        how = ("through the proxy (IFRT_USE_PROXY=1)" if settings.use_proxy else
               "directly: ifrt ignores them (set IFRT_USE_PROXY=1 to go through the proxy)")
        print(f"proxy: {', '.join(proxies)} set; the coordinator is dialled {how}")
    return 0


def _print_unknown(lines: list[str]) -> None:
    for line in lines:
        print(f"warning: {line}")


def _print_launchers(launchers: list[dict[str, object]]) -> None:
    for found in launchers:
        print(f"launcher {found['source']}: " + ", ".join(f"{f}={found[f]}" for f in _LAUNCHER_FIELDS))


def _shown(field: str, value: object) -> object:
    """A setting as ``ifrt env`` shows it: the token only as set or not, never itself."""
    if field == "token":
        return "set" if value else "not set"
    if isinstance(value, tuple):
        return [getattr(v, "name", str(v)) for v in value]
    return value


def _status(args: argparse.Namespace) -> int:
    import time

    from ifrt import status, status_view  # imports grpc: only for this command

    if args.count is not None and (args.watch is None or args.count < 1):
        print("ifrt status: --count N needs --watch and N >= 1", file=sys.stderr)
        return 2
    try:
        settings = resolve(args.coordinator, token_file=args.token_file)
    except IfrtError as e:
        print(f"ifrt status: {safe(e)}", file=sys.stderr)
        return 2
    reports = 0
    try:
        while True:
            try:
                view = status.query(settings, args.timeout)
            except IfrtError as e:
                print(f"ifrt status: {type(e).__name__}: {safe(e)}", file=sys.stderr, flush=True)
                if args.watch is None:
                    return 1
            else:
                if args.watch is not None and not args.json:
                    print(f"--- {time.strftime('%H:%M:%S')}")
                print(json.dumps(view) if args.json else status_view.render(view), flush=True)
                if args.svg is not None and not _write_svg(args.svg, view):
                    return 1
            reports += 1
            if args.watch is None or (args.count is not None and reports >= args.count):
                return 0
            time.sleep(args.watch)  # the pace of the display, not a wait for anything
    except KeyboardInterrupt:
        return 0


def _write_svg(path: str, view: dict) -> bool:
    """Writes the picture of ``view`` to ``path`` (whole or not at all); says why on stderr when it cannot."""
    from ifrt.status_svg import svg

    partial = f"{path}.partial"
    try:
        with open(partial, "w", encoding="utf-8") as f:
            f.write(svg(view))
        os.replace(partial, path)
    except OSError as e:
        print(f"ifrt status: cannot write the picture to {path}: {e}", file=sys.stderr, flush=True)
        return False
    return True


def _doctor(args: argparse.Namespace) -> int:
    from ifrt.client import Client

    _log_to_stderr(args.verbose)
    try:
        with Client(args.coordinator, process_id=args.process_id, num_processes=args.num_processes,
                    plugin=args.plugin, timeout=args.timeout, transfer_bind=args.transfer_bind,
                    token_file=args.token_file) as client:
            client.discover()
            report = client.preflight(args.check_timeout)
    except IfrtError as e:
        print(f"ifrt doctor: {type(e).__name__}: {safe(e)}", file=sys.stderr)
        return 1
    print(json.dumps(report.to_dict()) if args.json else safe_lines(report.describe()), flush=True)
    return 0 if report.ok else 1


def main(argv: list[str] | None = None) -> int:
    """Runs one command; a reader that closes the output early (``ifrt status | head``) ends it quietly, and so does
    Ctrl-C (exit 130, as a shell reports a process ended by SIGINT)."""
    try:
        code = _run(parser().parse_args(argv))
        sys.stdout.flush()  # here, not at exit, so that a closed pipe is caught below
        return code
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes at exit
        return 141  # as a shell reports a process ended by SIGPIPE
    except KeyboardInterrupt:
        print("ifrt: interrupted", file=sys.stderr, flush=True)
        return 130


def _log_to_stderr(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    waiting.log.setLevel(logging.INFO)  # what a wait waits for (an unreachable coordinator, peers): said, -v or not


def _run(args: argparse.Namespace) -> int:
    if args.command == "run":
        from ifrt.run.shell import main as run_agent  # imports grpc: only for this command

        return run_agent(args)
    if args.command == "agent-credential":
        return _agent_credential(args.host, args.key_file)
    if args.command == "status":
        return _status(args)
    if args.command == "plugins":
        return _plugins(args.json)
    if args.command == "env":
        return _env(args.json)
    if args.command == "doctor":
        return _doctor(args)
    return _discover(args)


def _discover(args: argparse.Namespace) -> int:
    from ifrt import render  # the topology and numpy: for the commands that discover, not for `ifrt run`'s agent
    from ifrt.client import Client
    from ifrt.mesh import network_lines

    _log_to_stderr(args.verbose)
    try:
        with Client(args.coordinator, process_id=args.process_id, num_processes=args.num_processes,
                    plugin=args.plugin, timeout=args.timeout, transfer_bind=args.transfer_bind,
                    token_file=args.token_file) as client:
            topology = client.discover()
    except IfrtError as e:
        print(f"ifrt discover: {type(e).__name__}: {safe(e)}", file=sys.stderr)
        return 1
    if args.json:
        print(topology.to_json())
        return 0
    print(render.summary(topology))
    print(f"this process: {topology.process_id}")
    print(render.table(topology))
    names = args.axes.split(",") if args.axes else None
    try:
        lines = network_lines(topology, args.mesh, names)
    except ValueError as e:  # a shape that does not hold the topology's devices, names that do not fit it
        print(f"ifrt discover: --mesh {'x'.join(map(str, args.mesh or ()))}: {safe(e)}", file=sys.stderr)
        return 2
    for line in lines:
        print(safe(line))
    return 0


def _mesh_shape(text: str) -> tuple[int, ...]:
    """``64x16x8`` -> (64, 16, 8); argparse's error for anything but positive sizes joined by ``x``."""
    try:
        shape = tuple(int(part) for part in text.lower().split("x"))
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive axis sizes joined by x, such as 64x16x8")
    return shape


if __name__ == "__main__":
    sys.exit(main())
