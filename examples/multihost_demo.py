"""The multi-host deployment run for real and checked step by step: 3 etcd members, 2 coordinator replicas (one
leads, one stands by, the journal in etcd) and 4 workers (examples/cluster_worker.py), each on a host of its own.

    python examples/multihost_demo.py compose [--compose "docker compose"] [--project ifrtdemo]
    python examples/multihost_demo.py netns

``compose`` runs docker-compose.yml (images built beforehand: scripts/compose-demo.sh prepares everything);
``netns`` makes the hosts as Linux network namespaces on a private bridge, no Docker (scripts/multihost.sh; root
and iproute2). The steps, each waited for with a deadline that names what is missing when it passes:

1. all 4 workers print the same topology (fingerprint and generation), from 4 hosts, and pass the pre-flight;
2. the leading replica is killed (SIGKILL): the standby takes over, every worker's session re-attaches to it and
   its answer to the worker's registration is the same topology, in the same generation;
3. one worker is killed (SIGKILL): the 3 others receive ProcessFailed for it.

Everything is torn down at the end, also on failure, Ctrl-C or SIGTERM. The last line says what was shown:

    compose: 4 workers on 4 hosts hold one topology (fingerprint 3f5a9c0e12d4...), failover kept it, a killed
    worker was reported to 3

and the exit status is 0 only if every step happened (1 if one did not, 2 on a usage or setup error).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKERS = [f"worker{i}" for i in range(4)]
COORDINATORS = ["coordinator1", "coordinator2"]
ETCD = ["etcd1", "etcd2", "etcd3"]
KILLED_WORKER = "worker3"
SERVING = "serving: replayed"  # what a replica logs when it starts to lead (coordinator/replica.py)
HEARTBEAT_TIMEOUT = "5"  # the coordinators' --heartbeat-timeout and --leader-ttl, as in docker-compose.yml
LEADER_TTL = "3"
PROXY_VARIABLES = ("http_proxy", "https_proxy", "grpc_proxy", "all_proxy")
"""Not passed on to the namespaces' processes: gRPC would send their calls to a proxy they cannot reach."""


class StepFailed(Exception):
    """A step did not happen before its deadline; the message says what is missing."""


class Lines:
    """The JSON lines a worker prints, read by a thread as they come; other lines are kept as text."""

    def __init__(self, name: str, stream) -> None:
        self.name = name
        self.seen: list[dict] = []
        self.text: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for raw in stream:
            line = raw.strip()
            try:
                parsed = json.loads(line)
            except ValueError:
                self.text.append(line)
                continue
            if isinstance(parsed, dict):
                self._queue.put(parsed)

    def mark(self) -> int:
        """The number of lines arrived so far: ``expect(..., after=mark())`` looks only at later ones."""
        with contextlib.suppress(queue.Empty):
            while True:
                self.seen.append(self._queue.get_nowait())
        return len(self.seen)

    def expect(self, match: Callable[[dict], bool], deadline: float, what: str, after: int = 0) -> dict:
        """The first line from the ``after``-th on (seen already, or arriving before ``deadline``) that ``match``es;
        StepFailed naming ``what`` if none does."""
        for line in self.seen[after:]:
            if match(line):
                return line
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=remaining)
            except queue.Empty:
                break
            self.seen.append(line)
            if match(line):
                return line
        last = self.seen[-3:] or self.text[-3:]
        raise StepFailed(f"{self.name} printed no {what} in time (its last lines: {last})")


class Compose:
    """The hosts are the services of docker-compose.yml, run by ``docker compose`` or ``docker-compose``."""

    label = "compose"

    def __init__(self, command: list[str], project: str, file: Path) -> None:
        self.base = [*command, "-p", project, "-f", str(file)]
        self._followers: list[subprocess.Popen] = []

    def _compose(self, *args: str, timeout: float = 300) -> str:
        done = subprocess.run([*self.base, *args], capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise StepFailed(f"`{shlex.join([*self.base, *args])}` failed ({done.returncode}): "
                             f"{(done.stderr or done.stdout).strip()[-2000:]}")
        return done.stdout

    def container(self, service: str) -> str:
        found = self._compose("ps", "-q", service).split()
        if not found:
            raise StepFailed(f"service {service} has no container")
        return found[0]

    def start(self) -> dict[str, Lines]:
        self._compose("up", "-d", "--no-build", *ETCD, *COORDINATORS, *WORKERS)
        lines = {}
        for name in WORKERS:  # docker logs: the same in Compose v1 and v2, from the container's start
            follower = subprocess.Popen(["docker", "logs", "-f", self.container(name)], stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, text=True)
            self._followers.append(follower)
            lines[name] = Lines(name, follower.stdout)
        return lines

    def log(self, name: str) -> str:
        done = subprocess.run(["docker", "logs", self.container(name)], capture_output=True, text=True, timeout=60)
        return done.stdout + done.stderr

    def kill(self, name: str) -> None:
        self._compose("kill", "-s", "SIGKILL", name)

    def close(self) -> None:
        for follower in self._followers:
            follower.kill()
            follower.wait()
        subprocess.run([*self.base, "down", "-v", "--remove-orphans", "-t", "5"], capture_output=True, timeout=300)


class Namespaces:
    """Each role on its own host: a network namespace with one address on a private bridge, no route out.

    A switch namespace holds the bridge; host namespaces are ``<prefix>-<role>`` with eth0 at SUBNET.<i>.
    Processes run under ``ip netns exec`` with a UTS namespace of their own, so each host has its own hostname;
    they are stopped by their pids, then the namespaces and the working directory are removed.
    """

    label = "multihost"

    def __init__(self, python: str) -> None:
        tag = os.getpid() % 250
        self.python = python
        self.prefix = f"ifrtmh{os.getpid()}"
        self.subnet = f"10.79.{tag}"
        self.roles = [*ETCD, *COORDINATORS, *WORKERS]
        self.switch = f"{self.prefix}-sw"
        self.dir = Path(tempfile.mkdtemp(prefix="ifrt-multihost-"))
        self.processes: dict[str, subprocess.Popen] = {}
        self._made: list[str] = []

    def address(self, role: str) -> str:
        return f"{self.subnet}.{self.roles.index(role) + 1}"

    def ns(self, role: str) -> str:
        return f"{self.prefix}-{role}"

    def _ip(self, *args: str) -> None:
        done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise StepFailed(f"`ip {shlex.join(args)}` failed: {done.stderr.strip()}")

    def _hosts(self) -> None:
        self._ip("netns", "add", self.switch)
        self._made.append(self.switch)
        self._ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        self._ip("-n", self.switch, "link", "set", "br0", "up")
        for i, role in enumerate(self.roles, start=1):
            ns = self.ns(role)
            self._ip("netns", "add", ns)
            self._made.append(ns)
            self._ip("-n", ns, "link", "set", "lo", "up")
            self._ip("-n", self.switch, "link", "add", f"p{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            self._ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0", "up")
            self._ip("-n", ns, "addr", "add", f"{self.address(role)}/24", "dev", "eth0")
            self._ip("-n", ns, "link", "set", "eth0", "up")

    def _run(self, role: str, argv: list[str], env: dict | None = None, stdout=None) -> subprocess.Popen:
        # ip netns exec, unshare and sh all exec: the pid is the program's own, so a kill reaches it.
        env = {k: v for k, v in (os.environ if env is None else env).items() if k.lower() not in PROXY_VARIABLES}
        command = ["ip", "netns", "exec", self.ns(role), "unshare", "--uts", "sh", "-c",
                   'hostname "$0" && exec "$@"', role, *argv]
        log = open(self.dir / f"{role}.log", "ab")  # noqa: SIM115 (the child keeps it)
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=stdout or log, stderr=log,
                                   env=env, text=stdout is not None)
        log.close()
        self.processes[role] = process
        return process

    def start(self) -> dict[str, Lines]:
        self._hosts()
        etcd = shutil.which("etcd") or "/usr/bin/etcd"
        cluster = ",".join(f"{m}=http://{self.address(m)}:2380" for m in ETCD)
        for member in ETCD:
            a = self.address(member)
            self._run(member, [etcd, "--name", member, "--data-dir", str(self.dir / member),
                               "--listen-client-urls", f"http://{a}:2379", "--advertise-client-urls", f"http://{a}:2379",
                               "--listen-peer-urls", f"http://{a}:2380", "--initial-advertise-peer-urls",
                               f"http://{a}:2380", "--initial-cluster", cluster, "--initial-cluster-state", "new",
                               "--initial-cluster-token", "ifrt-demo"])
        store = "etcd://" + ",".join(f"{self.address(m)}:2379" for m in ETCD)
        coordinator = str(Path(self.python).with_name("ifrt-coordinator"))
        for name in COORDINATORS:
            a = self.address(name)
            self._run(name, [coordinator, "--bind", f"{a}:8476", "--num-processes", "4", "--cluster-id", "demo",
                             "--store", store, "--advertise", f"{a}:8476", "--heartbeat-timeout", HEARTBEAT_TIMEOUT,
                             "--leader-ttl", LEADER_TTL])
        lines = {}
        for i, name in enumerate(WORKERS):
            env = {k: v for k, v in os.environ.items() if not k.startswith("IFRT_")}
            env.update(IFRT_COORDINATOR=",".join(f"{self.address(c)}:8476" for c in COORDINATORS),
                       IFRT_PROCESS_ID=str(i), IFRT_NUM_PROCESSES="4", IFRT_CLUSTER_ID="demo",
                       IFRT_CPU_DEVICE_COUNT="2", PYTHONUNBUFFERED="1")
            process = self._run(name, [self.python, str(ROOT / "examples" / "cluster_worker.py"), "--preflight"],
                                env=env, stdout=subprocess.PIPE)
            lines[name] = Lines(name, process.stdout)
        return lines

    def log(self, name: str) -> str:
        return (self.dir / f"{name}.log").read_text(errors="replace")

    def kill(self, name: str) -> None:
        process = self.processes[name]
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)
        process.wait(30)

    def close(self) -> None:
        for process in self.processes.values():  # our own children, by pid
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGKILL)
        for process in self.processes.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(30)
        for ns in self._made:  # anything else still inside (nothing, normally) goes with its pid too
            listed = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30).stdout
            for pid in listed.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        shutil.rmtree(self.dir, ignore_errors=True)


def wait_for(check: Callable[[], object], deadline: float, what: str, interval: float = 0.1) -> object:
    """Polls ``check`` until it returns something truthy; StepFailed naming ``what`` at the deadline."""
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise StepFailed(f"{what}: not within the step's deadline")
        time.sleep(interval)  # polling a log or a container: the condition itself is what ends the wait


def serving_line(deployment, name: str) -> str | None:
    return next((line for line in deployment.log(name).splitlines() if SERVING in line), None)


def run(deployment, step_timeout: float, say: Callable[[str], None]) -> str:
    """The three steps; returns the closing line, raises StepFailed naming the step that did not happen."""
    say(f"starting 3 etcd members, 2 coordinator replicas and {len(WORKERS)} workers, each on its own host")
    lines = deployment.start()

    # 1. One topology in every worker.
    deadline = time.monotonic() + step_timeout
    first = {name: lines[name].expect(lambda line: "topology" in line, deadline, "topology") for name in WORKERS}
    fingerprints = {line["topology"] for line in first.values()}
    generations = {line["generation"] for line in first.values()}
    if len(fingerprints) != 1 or len(generations) != 1:
        raise StepFailed(f"the workers hold different topologies: "
                         f"{ {n: (line['generation'], line['topology'][:12]) for n, line in first.items()} }")
    fingerprint, generation = fingerprints.pop(), generations.pop()
    hosts = {(line["hostname"], line["address"].rpartition(":")[0]) for line in first.values()}
    if len(hosts) != len(WORKERS):
        raise StepFailed(f"the {len(WORKERS)} workers are not on {len(WORKERS)} hosts: {sorted(hosts)}")
    say(f"{len(WORKERS)} workers hold generation {generation}, fingerprint {fingerprint[:12]}...: "
        + ", ".join(f"{line['hostname']} ({line['address']})" for line in first.values()))
    checks = {name: lines[name].expect(lambda line: "preflight" in line, deadline, "pre-flight report")
              for name in WORKERS}
    failed = {name: line["preflight"] for name, line in checks.items() if not line["preflight"].get("ok")}
    if failed:
        raise StepFailed(f"the pre-flight found unreachable transfer endpoints: {failed}")
    pairs = next(iter(checks.values()))["preflight"]["pairs_probed"]
    say(f"pre-flight: {pairs} pairs probed, every transfer endpoint reachable (in every worker)")

    # 2. The leading replica killed: the standby takes over and nothing is lost.
    deadline = time.monotonic() + step_timeout
    leader = wait_for(lambda: next((c for c in COORDINATORS if serving_line(deployment, c)), None), deadline,
                      "no coordinator replica logged that it leads")
    standby = next(c for c in COORDINATORS if c != leader)
    say(f"{leader} leads; killing it (SIGKILL)")
    marks = {name: lines[name].mark() for name in WORKERS}
    killed_at = time.monotonic()
    deployment.kill(leader)
    took_over = wait_for(lambda: serving_line(deployment, standby), deadline,
                         f"the standby {standby} did not take over")
    say(f"{standby} took over after {time.monotonic() - killed_at:.1f}s ({SERVING}{took_over.split(SERVING, 1)[1]})")
    rechecked = {name: lines[name].expect(lambda line: line.get("rechecked") is not None, deadline,
                                          f"re-attached session and re-registration with {standby}", marks[name])
                 for name in WORKERS}
    changed = {n: (line["generation"], line["rechecked"][:12]) for n, line in rechecked.items()
               if (line["rechecked"], line["generation"]) != (fingerprint, generation)}
    if changed:
        raise StepFailed(f"after the takeover the topology changed (expected generation {generation}, fingerprint "
                         f"{fingerprint[:12]}...): {changed}")
    say(f"{len(WORKERS)} sessions re-attached to {next(iter(rechecked.values()))['coordinator']} after "
        f"{time.monotonic() - killed_at:.1f}s; its answer in every worker: generation {generation}, fingerprint "
        f"{fingerprint[:12]}... (unchanged)")

    # 3. A worker killed: the others are told.
    deadline = time.monotonic() + step_timeout
    victim = WORKERS.index(KILLED_WORKER)
    say(f"killing {KILLED_WORKER} (process {victim}, SIGKILL)")
    marks = {name: lines[name].mark() for name in WORKERS}
    killed_at = time.monotonic()
    deployment.kill(KILLED_WORKER)
    told = {name: lines[name].expect(
                lambda line: line.get("event") == "ProcessFailed" and line.get("process_id") == victim, deadline,
                f"ProcessFailed for process {victim}", marks[name])
            for name in WORKERS if name != KILLED_WORKER}
    say(f"{len(told)} workers received ProcessFailed for process {victim} within {time.monotonic() - killed_at:.1f}s: "
        f"{next(iter(told.values()))['reason']}")
    return (f"{len(WORKERS)} workers on {len(hosts)} hosts hold one topology (fingerprint {fingerprint[:12]}...), "
            f"failover kept it, a killed worker was reported to {len(told)}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--step-timeout", type=float, default=120.0, metavar="SECONDS",
                   help="how long each step may take before the demo fails, naming what is missing "
                        "(default %(default)s)")
    sub = p.add_subparsers(dest="backend", required=True)
    c = sub.add_parser("compose", help="the hosts are docker-compose.yml's services (images already built)")
    c.add_argument("--compose", default="docker compose", metavar="COMMAND",
                   help="the compose command: 'docker compose' (v2) or 'docker-compose' (v1) (default %(default)r)")
    c.add_argument("--project", default="ifrtdemo", help="compose project name (default %(default)s)")
    c.add_argument("--file", type=Path, default=ROOT / "docker-compose.yml", help="compose file (default %(default)s)")
    n = sub.add_parser("netns", help="the hosts are network namespaces on a private bridge (root, iproute2)")
    n.add_argument("--python", default=sys.executable,
                   help="the interpreter (with ifrt-topology[etcd] installed) the workers and coordinators run with")
    args = p.parse_args(argv)

    deployment = (Compose(shlex.split(args.compose), args.project, args.file) if args.backend == "compose"
                  else Namespaces(args.python))

    def say(text: str) -> None:
        print(f"{deployment.label}: {text}", flush=True)

    def terminate(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, terminate)
    try:
        closing = run(deployment, args.step_timeout, say)
    except StepFailed as e:
        say(f"FAILED: {e}")
        return 1
    except KeyboardInterrupt as e:
        say(f"interrupted ({e or 'SIGINT'})")
        return 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not stop the teardown halfway
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        say("tearing down")
        deployment.close()
    say(closing)
    return 0


if __name__ == "__main__":
    sys.exit(main())
