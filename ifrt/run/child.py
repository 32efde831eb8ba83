"""A worker's first moments: asks the kernel to SIGKILL it when its agent dies, then becomes the worker's program.

    python -I -S child.py AGENT_PID[:UID:GID:GROUP,...] COMMAND [ARGS...]

``ifrt run`` starts every worker through this file (``workers.guarded``): with a user (``ifrt run --worker-user``,
an agent running as root), first its groups, gid and uid (real, effective and saved: no way back); then
``prctl(PR_SET_PDEATHSIG, SIGKILL)`` (after the switch, which clears it), a check that the agent is still its parent
(an agent that died before the prctl would never send the signal: the standard race), then ``execvp`` of the command
in the same process (same pid, process group, descriptors and environment), so the worker ends the moment its agent
does, however the agent ended (SIGKILL included).

Why an exec wrapper and not ``subprocess.Popen(preexec_fn=...)``: the agent is threaded (gRPC, its output readers),
and code run between fork and exec in a threaded process may deadlock on a lock another thread held at the fork
(Python's documentation warns against ``preexec_fn`` there); it also keeps Popen off its fast ``vfork`` path. A
wrapper runs in a fresh single-threaded interpreter instead, for ~10 ms per start (``-I -S``: no site, no
environment read, nothing imported but the standard library's ctypes). The signal goes with the *thread* that forked
the worker, so the agent forks every worker from one thread that lives as long as it does (``workers._spawn``).
The setting survives the exec, except into a set-user-ID program, which the kernel clears it for.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
EXIT_NOT_FOUND, EXIT_NOT_EXECUTABLE = 127, 126
"""As a shell's: the command is not there; it is there but cannot be run."""


def main(argv: list[str]) -> None:
    """Becomes the user ``argv[1]`` names (if any), asks for the parent-death signal, checks the agent ``argv[1]``
    names still lives, execs ``argv[2:]``."""
    agent_pid, *user = argv[1].split(":")
    agent, command = int(agent_pid), argv[2:]
    if user:
        uid, gid, groups = int(user[0]), int(user[1]), [int(g) for g in user[2].split(",") if g]
        try:
            os.setgroups(groups)
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
        except OSError as e:
            _say(f"cannot run the worker as uid {uid}, gid {gid}: {e.strerror}")
            os._exit(EXIT_NOT_EXECUTABLE)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        _say(f"no parent-death signal ({os.strerror(ctypes.get_errno())}): this worker would outlive its agent")
    if os.getppid() != agent:  # the agent died before the prctl: nothing would end this worker now
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        os.execvp(command[0], command)
    except OSError as e:
        _say(f"cannot start the worker command {command[0]!r}: {e.strerror}")
        os._exit(EXIT_NOT_FOUND if isinstance(e, FileNotFoundError) else EXIT_NOT_EXECUTABLE)


def _say(what: str) -> None:
    sys.stderr.write(f"ifrt run: {what}\n")
    sys.stderr.flush()


if __name__ == "__main__":
    main(sys.argv)
