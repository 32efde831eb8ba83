"""In-place recovery for PyTorch (``ifrt run --recover replace`` with ``ifrt.torch``'s ``on_failure="recover"``): a
failed process is replaced, the survivors keep their PIDs and re-form their group with it, and the newcomer takes
its state from a peer. The example run whole (real coordinator, agents and gloo workers), and the pieces it rests on:
fail fast that lets a replaced peer back in, and a recovery wait that names who is missing."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ifrt
from ifrt import events, failfast
from ifrt.errors import DiscoveryTimeout, PeerFailed
from ifrt.recovery import Peers

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_recover.py"
EXAMPLE_TIMEOUT_S = 120


def run_example(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("IFRT_")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, str(EXAMPLE), "--processes", "4", *args], capture_output=True, text=True,
                          timeout=EXAMPLE_TIMEOUT_S, env=env)


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "moment"), [("KILL", "after"), ("STOP", "before")])
def test_the_example_replaces_a_killed_or_hung_process_and_matches_its_reference(sig, moment):
    done = run_example("--signal", sig, "--moment", moment)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-6000:]
    assert "recover: outputs match reference (max |difference|" in done.stdout
    assert f"after process 2 got SIG{sig} {moment} its step 5" in done.stdout
    assert "the survivors kept their PIDs" in done.stdout and "no checkpoint was read" in done.stdout
    if moment == "after":  # died after its backward: the step was kept nowhere, then run again
        assert "every survivor's vote on step 5 kept it nowhere" in done.stdout


@pytest.mark.parametrize("page", ["pytorch.md", "failures.md"])
def test_the_docs_loop_is_the_examples_own(page):
    """The lines docs/ shows for a recovery are the example's, in order and nested as shown (the example adds
    only its failure injection and its records between them), so the example's run runs them."""
    text = (ROOT / "docs" / page).read_text()
    block = re.search(r"```python\n(healing = ifrt\.torch\.Healing.*?)```", text, re.S)
    assert block, f"docs/{page} shows no Healing loop"
    shown = block.group(1).splitlines()
    lines = EXAMPLE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == shown[0])
    indent = lines[start][:len(lines[start]) - len(lines[start].lstrip())]
    found = iter(lines[start:])
    missing = [line for line in shown if not any(candidate == indent + line for candidate in found)]
    assert not missing, f"docs/{page}'s lines not in {EXAMPLE.name} as shown: {missing}"


@pytest.mark.slow
def test_a_second_failure_during_the_recovery_is_replaced_too():
    done = run_example("--second-failure")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-6000:]
    assert "and process 3 was SIGKILLed during the recovery: the survivors kept their PIDs" in done.stdout
    assert "process 3 (pid" in done.stdout and "took step 5 from process" in done.stdout
    assert "recover: outputs match reference (max |difference|" in done.stdout


def test_a_replaced_peer_is_no_failure_under_recover_and_a_long_recovery_names_it(start_coordinator):
    coordinator = start_coordinator("--heartbeat-timeout", "1", num_processes=2, log_level="WARNING")
    env = {k: v for k, v in os.environ.items() if not k.startswith("IFRT_")}
    env.update(IFRT_COORDINATOR=coordinator.address, IFRT_PROCESS_ID="1", IFRT_NUM_PROCESSES="2",
               IFRT_CPU_DEVICE_COUNT="1", PYTHONPATH=str(ROOT))
    peer = subprocess.Popen([sys.executable, "-c", "import os, ifrt; ifrt.Client(transfer=False).discover(); "
                             "print('up', flush=True); os._exit(3)"], env=env, stdout=subprocess.PIPE, text=True)
    client = ifrt.Client(coordinator.address, process_id=0, num_processes=2, transfer=False)
    try:
        topology = client.discover()
        assert failfast.failure_for(events.ProcessFailed(1, "lost"), topology, recover=True) is None
        assert failfast.failure_for(events.ProcessRestarted(1, 1), topology, recover=True) is None
        assert isinstance(failfast.failure_for(events.ProcessFailed(0, "x"), topology, recover=True), PeerFailed)
        assert isinstance(failfast.failure_for(events.ProcessRestarted(1, 1), topology), PeerFailed)
        peers = Peers(client)
        mark = peers.mark()
        peer.wait(30)
        assert list(peers.wait_failed(mark, 10)) == [1]  # its exit, declared by the coordinator
        began = time.monotonic()
        with pytest.raises(DiscoveryTimeout, match=r"recovery of process 0 timed out after 1s: processes not "
                                                   r"replaced yet: 1 \(failed: "):
            peers.wait_whole(mark, time.monotonic() + 1.0, "process 0")
        assert time.monotonic() - began < 5
    finally:
        client.close()
        if peer.poll() is None:
            peer.kill()


STARTS_IN_PLACE = ("import os, ifrt.torch, torch.distributed as dist; "
                   "t = ifrt.torch.init_process_group(on_failure='recover', timeout=60); "
                   "print('started', dist.get_rank(), dist.get_world_size(), flush=True); os._exit(0)")


def test_a_start_that_a_peers_failure_broke_waits_for_its_replacement_under_recover(start_coordinator):
    coordinator = start_coordinator("--heartbeat-timeout", "1", num_processes=2, log_level="WARNING")
    env = {k: v for k, v in os.environ.items() if not k.startswith("IFRT_")}
    env.update(IFRT_COORDINATOR=coordinator.address, IFRT_NUM_PROCESSES="2", IFRT_CPU_DEVICE_COUNT="1",
               PYTHONPATH=str(ROOT))

    def start(process_id: int, code: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", code], env={**env, "IFRT_PROCESS_ID": str(process_id)},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    survivor = start(0, STARTS_IN_PLACE)
    dying = start(1, "import os, ifrt; ifrt.Client(transfer=False).discover(); os._exit(3)")  # gone before its start
    newcomer = None
    try:
        assert dying.wait(60) == 3
        said = []
        for line in survivor.stderr:  # ends (and fails below) if the survivor exits instead of waiting
            said.append(line)
            if "recovery of process 0 waiting" in line and "processes not replaced yet: 1 (failed:" in line:
                break
        assert survivor.poll() is None, "".join(said)[-3000:]
        newcomer = start(1, STARTS_IN_PLACE)
        out, err = survivor.communicate(timeout=60)
        assert survivor.returncode == 0, err[-3000:]
        assert "started 0 2" in out
        assert "started 1 2" in newcomer.communicate(timeout=60)[0]
    finally:
        for process in (survivor, dying, newcomer):
            if process is not None and process.poll() is None:
                process.kill()
