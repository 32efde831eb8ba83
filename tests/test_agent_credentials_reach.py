"""A worker cannot reach its agent's credential or the agent key in the configurations docs/security.md gives: the
workers as another user (``ifrt run --worker-user``, the files owned by root with mode 0400), or the agent as the
workers' user with the credential handed on a descriptor by a more privileged parent. A real ``ifrt run`` behind a
real coordinator; its worker (tests/credential_walk_worker.py) walks its ancestors' cmdline, environ, fd/, memory and
every file they name, as an attacker would, and reports what it found. Where a file stays readable by the workers'
user, the agent says so at start."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ifrt.agent_credential import (
    UnixUser,
    descriptor_of,
    host_credential,
    reach_warnings,
    read_secret,
    readable_by,
)
from ifrt.errors import InvalidArgument
from tests.helpers import BIN, HOST, secret_file
from tests.run_agents import loopback_env

NOBODY = 65534
WALKER = Path(__file__).with_name("credential_walk_worker.py")
ROOT = Path(__file__).parent.parent
SYSTEM_PYTHON = "/usr/bin/python3"
"""An interpreter an unprivileged user can run (the virtualenv's may sit under root's home)."""
AS_NOBODY = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
WALK = [SYSTEM_PYTHON, "-I", str(WALKER)]

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not Path(SYSTEM_PYTHON).exists() or not shutil.which("setpriv"),
                                reason="needs root (to start processes as uid 65534), setpriv and /usr/bin/python3")


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory every user may enter (pytest's own is root's only, which would hide any file in it)."""
    path = Path(tempfile.mkdtemp(prefix="ifrt-reach-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def job(start_coordinator, shared: Path):
    """A coordinator behind the token with an agent key (root's, 0400); the token the workers' user's (they are given
    it); this host's credential."""
    token = secret_file(shared / "token", "the job's token")
    os.chown(token, NOBODY, NOBODY)
    key_file = secret_file(shared / "agent-key")
    key_file.chmod(0o400)
    coordinator = start_coordinator("--token-file", str(token), "--agent-key-file", str(key_file), num_processes=1)
    key = key_file.read_text().strip()
    return coordinator, token, key_file, key, host_credential(key, HOST)


def look_for(**secrets: str) -> str:
    return ",".join(f"{name}={hashlib.sha256(value.encode()).hexdigest()}" for name, value in secrets.items())


def walked(command: list[str], env: dict[str, str], stdin_text: str | None = None) -> tuple[dict, str]:
    """Runs the agent ``command`` to its end (its worker walks once and exits 0); the walk's report and the agent's
    stderr."""
    process = subprocess.Popen(command, env=env, stdin=subprocess.PIPE if stdin_text is not None else
                               subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = process.communicate(stdin_text, timeout=120)
    reports = [line.split("walk ", 1)[1] for line in out.splitlines() if "walk {" in line]
    assert process.returncode == 0 and len(reports) == 1, f"exit {process.returncode}\n{out[-3000:]}\n{err[-3000:]}"
    return json.loads(reports[0]), err


def runs_as_nobody() -> str | None:
    """Why the agent cannot run as uid 65534 here (None: it can): the system interpreter must import this tree and
    its dependencies from the virtualenv's site-packages, the same Python version."""
    purelib = sysconfig.get_paths()["purelib"]
    probe = subprocess.run([*AS_NOBODY, SYSTEM_PYTHON, "-c", "import grpc, google.protobuf, ifrt.run.shell, sys; "
                            "print(sys.version_info[:2])"], env={"PYTHONPATH": f"{purelib}:{ROOT}"},
                           capture_output=True, text=True)
    if probe.returncode != 0 or probe.stdout.strip() != str(tuple(sys.version_info[:2])):
        return (f"uid {NOBODY} cannot run this tree with {SYSTEM_PYTHON} and {purelib} ({probe.stderr.strip()[-200:]}"
                f"{probe.stdout.strip()}): needed to start the agent as the workers' user")
    return None


def test_workers_run_as_another_user_reach_neither_the_credential_nor_the_key(job, shared):
    # The configuration docs/security.md gives first: the agent as root, the secrets' files root's with mode 0400, in
    # a directory anyone may enter, named on its command line and in its environment, as in the attack.
    coordinator, token, key_file, key, credential = job
    credential_file = secret_file(shared / "credential", credential)
    credential_file.chmod(0o400)
    for given, extra in ((["--agent-credential-file", str(credential_file)], {}),
                         ([], {"IFRT_AGENT_KEY_FILE": str(key_file)})):
        env = loopback_env(coordinator.address, WALK_LOOK_FOR=look_for(credential=credential, key=key), **extra)
        report, err = walked([str(BIN / "ifrt"), "run", "--worker-user", str(NOBODY), "--token-file", str(token),
                              *given, "--", *WALK], env)
        assert report["found"] == {}, report
        assert any("cmdline of" not in d for d in report["denied"]), report  # it tried, and was refused
        assert "readable by the user the workers run as" not in err and "run as root" not in err, err


@pytest.mark.parametrize("source", ["-", "/dev/stdin"])
def test_an_agent_of_the_workers_user_given_the_credential_on_a_descriptor_keeps_it_from_them(job, shared, source):
    # Reproduced: the agent's memory (same user, dumpable) held the credential; a worker read it through
    # /proc/<agent>/mem ("found": {"credential": ["memory of <agent>"]}).
    if (why := runs_as_nobody()) is not None:
        pytest.skip(why)
    coordinator, token, _, key, credential = job
    env = {**loopback_env(coordinator.address, WALK_LOOK_FOR=look_for(credential=credential, key=key)),
           "PYTHONPATH": f"{sysconfig.get_paths()['purelib']}:{ROOT}", "HOME": str(shared)}
    agent = [*AS_NOBODY, SYSTEM_PYTHON, "-c", "import sys; from ifrt.cli import main; sys.exit(main())"]
    report, err = walked([*agent, "run", "--token-file", str(token), "--agent-credential-file", source, "--", *WALK],
                         env, stdin_text=credential + "\n")
    assert report["found"] == {}, report
    assert any(d.startswith("memory of") for d in report["denied"]), report
    assert "readable by the user the workers run as" not in err, err


def test_a_file_the_workers_user_can_read_is_reached_and_the_agent_says_so_at_start(job, shared):
    # What no agent can hide: a file of the workers' own user, named on the agent's command line.
    if (why := runs_as_nobody()) is not None:
        pytest.skip(why)
    coordinator, token, _, key, credential = job
    credential_file = secret_file(shared / "credential", credential)
    os.chown(credential_file, NOBODY, NOBODY)
    credential_file.chmod(0o400)
    env = {**loopback_env(coordinator.address, WALK_LOOK_FOR=look_for(credential=credential, key=key)),
           "PYTHONPATH": f"{sysconfig.get_paths()['purelib']}:{ROOT}", "HOME": str(shared)}
    agent = [*AS_NOBODY, SYSTEM_PYTHON, "-c", "import sys; from ifrt.cli import main; sys.exit(main())"]
    report, err = walked([*agent, "run", "--token-file", str(token), "--agent-credential-file", str(credential_file),
                          "--", *WALK], env)
    assert list(report["found"]) == ["credential"], report
    assert all(where.startswith(f"file {credential_file}") for where in report["found"]["credential"]), report
    warned = [line for line in err.splitlines() if "readable by the user the workers run as" in line]
    assert len(warned) == 1 and f"{credential_file} (mode 0400, owner {NOBODY}:{NOBODY})" in warned[0], err


def test_root_workers_are_said_to_reach_everything(job, shared):
    coordinator, token, _, _, credential = job
    credential_file = secret_file(shared / "credential", credential)
    credential_file.chmod(0o400)
    process = subprocess.run([str(BIN / "ifrt"), "run", "--token-file", str(token), "--agent-credential-file",
                              str(credential_file), "--", sys.executable, "-c", "pass"],
                             env=loopback_env(coordinator.address), capture_output=True, text=True, timeout=120)
    assert process.returncode == 0, process.stderr
    assert f"the workers run as root: they can read the agent credential file {credential_file}" in process.stderr


# The pieces, on their own.

def test_a_descriptor_source_is_read_once_and_closed():
    assert [descriptor_of(p) for p in ("-", "/dev/stdin", "/dev/fd/7", "/proc/self/fd/9", "/etc/cred")] == [
        0, 0, 7, 9, None]
    read, write = os.pipe()
    os.write(write, b"  the credential \n")
    os.close(write)
    assert read_secret(f"/dev/fd/{read}", "a test") == "the credential"
    with pytest.raises(OSError):
        os.fstat(read)  # closed: nothing started later inherits it
    empty, write = os.pipe()
    os.close(write)
    with pytest.raises(InvalidArgument, match=rf"descriptor {empty} \('/dev/fd/{empty}', a test\) held 0 characters"):
        read_secret(f"/dev/fd/{empty}", "a test")


def test_reach_is_judged_by_owner_mode_and_the_directories_above(shared):
    nobody, other = UnixUser(NOBODY, NOBODY, ()), UnixUser(1234, 1234, (NOBODY,))
    secret = secret_file(shared / "secret")
    secret.chmod(0o400)
    assert readable_by(str(secret), nobody) is None  # root's, 0400
    os.chown(secret, NOBODY, 0)
    assert readable_by(str(secret), nobody) is not None and readable_by(str(secret), other) is None
    os.chown(secret, 0, NOBODY)
    secret.chmod(0o440)
    assert readable_by(str(secret), other) is not None  # by its group
    shared.chmod(0o700)
    assert readable_by(str(secret), other) is None  # the directory above is root's only
    shared.chmod(0o755)
    assert reach_warnings({"the key": str(secret), "a descriptor": "-", "none": None}, other)[0].startswith(
        f"the key {secret} (mode 0440, owner 0:{NOBODY}) is readable by the user the workers run as (uid 1234)")
    assert reach_warnings({"a descriptor": "-"}, UnixUser(0, 0, ())) == []


def test_the_agent_is_not_dumpable():
    probe = ("import ctypes, sys; from ifrt.agent_credential import hide_this_process; "
             "assert hide_this_process() is None; print(ctypes.CDLL(None).prctl(3, 0, 0, 0, 0))")
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True).stdout.strip() == "0"


def test_workers_of_another_user_register_through_the_agents_socket(job, shared):
    if (why := runs_as_nobody()) is not None:
        pytest.skip(why)
    coordinator, token, key_file, _, _ = job
    program = "import os, ifrt; ifrt.discover(); print('discovered as uid', os.getuid(), 'home', os.environ['HOME'])"
    env = {**loopback_env(coordinator.address, IFRT_AGENT_KEY_FILE=str(key_file)),
           "PYTHONPATH": f"{sysconfig.get_paths()['purelib']}:{ROOT}"}
    process = subprocess.run([str(BIN / "ifrt"), "run", "--worker-user", "nobody", "--token-file", str(token), "--",
                              SYSTEM_PYTHON, "-c", program], env=env, capture_output=True, text=True, timeout=120)
    assert process.returncode == 0, process.stdout + process.stderr
    assert f"discovered as uid {NOBODY} home /nonexistent" in process.stdout, process.stdout + process.stderr
    assert "serving this host's workers on" in process.stderr, process.stderr  # through the agent's socket


def test_an_unknown_worker_user_is_refused_before_anything_starts():
    process = subprocess.run([str(BIN / "ifrt"), "run", "--worker-user", "no-such-user", "--", "true"],
                             env=loopback_env("127.0.0.1:1"), capture_output=True, text=True, timeout=60)
    assert process.returncode == 2, process.stderr
    assert "--worker-user 'no-such-user' is no user of this host: expected a user name or uid" in process.stderr
