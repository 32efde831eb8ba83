"""``ifrt run``'s flags: each one with its help, and what is wrong with a combination of them."""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

from ifrt.agent_credential import AGENT_CREDENTIAL_FILE_ENV, AGENT_KEY_FILE_ENV
from ifrt.errors import IfrtError
from ifrt.run.agent import DEFAULT_REPLACE_TIMEOUT_S, Recover
from ifrt.run.local_server import SOCKET_NAME, socket_path_problem
from ifrt.run.worker_link import AGENT, WORKER_LINKS
from ifrt.run.workers import WorkerUser, worker_user
from ifrt.settings import AGENT_SOCKET_ENV, COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV

DEFAULT_GRACE_S = 5.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``ifrt run``."""
    p.add_argument("--nproc-per-host", type=int, default=1, metavar="N",
                   help="workers to start on this host (default %(default)s); each gets IFRT_LOCAL_RANK and "
                        "IFRT_LOCAL_WORLD_SIZE")
    p.add_argument("--max-restarts", type=int, default=None, metavar="N",
                   help="restarts of the whole job (and, with --recover replace, replacements of one process) the "
                        "coordinator may decide before every agent gives up: the job's "
                        "budget, the same for every agent (default: the job's, which is the coordinator's "
                        "--max-restarts, else the first agent's, else 0: the first failure ends the job); an agent "
                        "that states another than the job's is refused")
    p.add_argument("--recover", choices=[r.value for r in Recover], default=Recover.RESTART.value,
                   help="what a failed worker costs (default %(default)s). restart: every agent stops its workers and "
                        "the coordinator starts the job's next attempt, every worker anew. replace: only the failed "
                        "worker is started anew by its agent, with the same process id and environment, while every "
                        "other worker keeps running (a worker declared failed while it still runs, hung, is killed "
                        "first); the program re-forms its groups in place (ifrt.torch.recover, see "
                        "docs/failures.md). Each replacement counts against --max-restarts; a worker that exits "
                        "with the fail-fast code of a peer's failure (75) or a lost coordinator (69), as a program "
                        "that did not opt in does, restarts the job as with restart. Give every agent of the job the "
                        "same --recover")
    p.add_argument("--spare-host", action="store_true",
                   help="a spare host (with --recover replace): it joins the job but runs no worker until the "
                        "coordinator hands it every process id of a lost host (one whose agent and worker are gone "
                        "longer than the heartbeat timeout), then runs one worker per id, with that id, and is an "
                        "ordinary agent of the job; --nproc-per-host is how many workers it can run. It does not "
                        "count against the job's processes (see docs/failures.md, \"A lost host\")")
    p.add_argument("--replace-timeout", type=float, default=DEFAULT_REPLACE_TIMEOUT_S, metavar="SECONDS",
                   help="with --recover replace: how long the agents wait for another host's failed worker to be "
                        "replaced, taken over by a spare host, or its agent to come back, saying every few seconds "
                        "which host they wait for; then they ask the coordinator to go on without those processes "
                        "(a shrink: a new generation over the survivors, where the coordinator runs with "
                        "--min-processes and at least that many remain), else the job ends as without replace: the "
                        "next attempt of the whole job, or the restarts exhausted (default %(default)s)")
    p.add_argument("--spare", type=int, default=0, metavar="N",
                   help="with --recover replace: keep N warm spares on this host (default %(default)s), started "
                        "after the workers with the same command and environment less the rank's variables; each "
                        "imports the program and waits inside ifrt (init_process_group, discover) holding no session "
                        "until a replacement is decided here, then takes the failed worker's process id at once (no "
                        "process start, no import). A spare is not one of the job's workers; it must have the failed "
                        "process's devices (count, platform, kind), else the coordinator refuses it and the "
                        "replacement counts as failed. Each spare costs the memory of an imported program")
    p.add_argument("--grace-seconds", type=float, default=DEFAULT_GRACE_S, metavar="SECONDS",
                   help="how long a stopped worker gets between SIGTERM and SIGKILL (default %(default)s; a "
                        "worker stopped by SIGSTOP gets SIGKILL at once)")
    p.add_argument("--worker-link", choices=WORKER_LINKS, default=AGENT,
                   help="how the workers reach the coordinator (default %(default)s). agent: each worker registers "
                        "and keeps its session through this agent, over a Unix socket in a directory only this user "
                        f"may enter (${AGENT_SOCKET_ENV}): the host costs the coordinator one registration call and "
                        "one session, and a worker's exit is reported the moment the agent sees it; the workers' "
                        "other calls (barriers, key-values) go to the coordinator. direct: each worker on its own "
                        "connection, registration and session, as a process started without ifrt run")
    p.add_argument("--no-prefix", action="store_true",
                   help="leave the workers' output as it is (by default each line starts with '[<process id>] ', "
                        "or '[local <rank>] ' until the coordinator has given the id)")
    p.add_argument("--coordinator", metavar="HOST:PORT[,HOST:PORT...]",
                   help=f"coordinator address(es) (default ${COORDINATOR_ENV}, else the launcher's); the workers get "
                        f"the same as ${COORDINATOR_ENV}")
    p.add_argument("--token-file", metavar="PATH",
                   help="file holding the cluster's token, if the coordinator requires one (default "
                        "$IFRT_TOKEN_FILE, or $IFRT_TOKEN itself); the workers read the same. TLS from "
                        "$IFRT_TLS_CA, $IFRT_TLS_CERT, $IFRT_TLS_KEY, passed on to the workers")
    p.add_argument("--agent-credential-file", metavar="PATH",
                   help="file holding this host's agent credential (`ifrt agent-credential --host H` prints it), "
                        "if the coordinator binds agents to hosts (its --agent-key-file; required with a token): the "
                        "agent acts for the host the credential names and no other (default "
                        f"${AGENT_CREDENTIAL_FILE_ENV}). '-' (or /dev/fd/N) reads it from stdin (descriptor N) to "
                        "its end, then closes it, before any worker starts. The agent reads it once, keeps it in "
                        "memory only and is non-dumpable (its /proc entries closed to other processes of its "
                        "user); the workers never get it, but a file stays readable by whoever its mode allows: the "
                        "agent warns at start when the workers' user can read it (see --worker-user and "
                        "docs/security.md)")
    p.add_argument("--agent-key-file", metavar="PATH",
                   help="the coordinator's agent key, to derive this host's credential from (default "
                        f"${AGENT_KEY_FILE_ENV}; '-' or /dev/fd/N as for --agent-credential-file): simpler to hand "
                        "out, but a host that holds the key can act for any host; the workers never get it")
    p.add_argument("--worker-user", metavar="USER",
                   help="run the workers as USER (a name or uid; the agent must run as root): its uid, gid and "
                        "groups, HOME, USER and LOGNAME. With the credential or key file owned by the agent's user "
                        "and mode 0400, no worker can read it (workers that run as root can read everything). USER "
                        "must be able to run the worker command and read the token and TLS files the workers are "
                        "given; with --worker-link agent the agent's socket is handed to USER (default: the agent's "
                        "own user)")
    p.add_argument("--host-rank", type=int, metavar="R",
                   help=f"this host's rank among the job's hosts: worker ids are R * N + local rank (default "
                        f"${PROCESS_ID_ENV} or the launcher's rank of this agent, one agent per host; unset: the "
                        "coordinator assigns ids by host and local rank, the same in every attempt)")
    p.add_argument("--num-hosts", type=int, metavar="H",
                   help=f"the job's host count: workers get {NUM_PROCESSES_ENV} = H * N (default "
                        f"${NUM_PROCESSES_ENV} or the launcher's count of agents; unset: the coordinator's count)")
    p.add_argument("worker_command", nargs=argparse.REMAINDER, metavar="-- COMMAND [ARGS...]",
                   help="the worker's program, e.g. -- python train.py --steps 100")


def chosen_worker_user(args: argparse.Namespace) -> WorkerUser | str | None:
    """The user ``--worker-user`` names (None: the agent's own, nothing to switch), or what is wrong with it."""
    spec = getattr(args, "worker_user", None)
    if spec is None:
        return None
    try:
        user = worker_user(spec)
    except IfrtError as e:
        return str(e)
    if user.ids.uid == os.geteuid():
        return None
    if os.geteuid() != 0:
        return (f"--worker-user {spec} needs an agent that runs as root (it runs as uid {os.geteuid()}): only root may "
                "start processes as another user; start `ifrt run` as root, or leave --worker-user out")
    return user


def check(args: argparse.Namespace, command: list[str]) -> str | None:
    """What is wrong with the flags, or None."""
    if not command:
        return "no worker command given: expected `ifrt run [flags] -- COMMAND [ARGS...]`"
    if shutil.which(command[0]) is None:  # else every attempt's start would fail the same way
        return (f"the worker command {command[0]!r} is neither an executable file nor a program on PATH: expected "
                "a program to run, e.g. `-- python train.py`")
    for flag, value, minimum in (("--nproc-per-host", args.nproc_per_host, 1), ("--max-restarts", args.max_restarts, 0),
                                 ("--host-rank", args.host_rank, 0), ("--num-hosts", args.num_hosts, 1)):
        if value is not None and value < minimum:
            return f"{flag} {value} is out of range: expected an integer >= {minimum}"
    if args.spare_host and args.recover != Recover.REPLACE.value:
        return "--spare-host needs --recover replace: a spare host takes over a lost host's processes in place"
    if not args.replace_timeout > 0:
        return f"--replace-timeout {args.replace_timeout} is out of range: expected seconds > 0"
    if args.spare < 0:
        return f"--spare {args.spare} is out of range: expected an integer >= 0"
    if args.spare and args.recover != Recover.REPLACE.value:
        return (f"--spare {args.spare} needs --recover replace: a spare takes a failed worker's place while the others "
                f"keep running, and --recover {args.recover} restarts every worker instead")
    if getattr(args, "worker_link", AGENT) == AGENT:  # mkdtemp's names: the prefix and 8 characters
        sample = os.path.join(tempfile.gettempdir(), "ifrt-agent-xxxxxxxx", SOCKET_NAME)
        if (problem := socket_path_problem(sample)) is not None:
            return f"--worker-link agent: {problem}"
    if not args.grace_seconds >= 0:
        return f"--grace-seconds {args.grace_seconds} is out of range: expected seconds >= 0"
    if args.host_rank is not None and args.num_hosts is not None and args.host_rank >= args.num_hosts:
        return f"--host-rank {args.host_rank} is out of range: expected it below --num-hosts ({args.num_hosts})"
    return None
