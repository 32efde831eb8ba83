"""A replacement checks a peer's state description against its own state before it allocates anything: a tensor it
holds must be described alike, one it does not hold (an optimizer's state before its first step) is bounded by its
own parameters, the count and size of the description are bounded, and a device kind it cannot use is refused.
Each refusal is one StateLost naming the peer, the tensor and both descriptions. The sender is a real process
(tests/heal_sender.py) over a real gloo group on loopback; this process receives as ``heal.run`` does.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ifrt.errors import StateLost
from ifrt.torch import heal
from tests.heal_sender import survivor

ROOT = Path(__file__).resolve().parent.parent
SOURCE = 7  # the sender's process id; it is rank 0 of the group


def fresh_state() -> dict:
    """What a replacement holds before it is healed: the same model, other values, an optimizer never stepped."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return {"model": model, "optimizer": torch.optim.Adam(model.parameters(), lr=0.01)}


@pytest.fixture(scope="module")
def sender_server() -> Iterator[Callable[..., int]]:
    """tests/heal_sender.py --serve, which imports torch once and forks a sender process per test;
    ``sender_server(*words)`` sends it one command and returns its answer."""
    server = subprocess.Popen([sys.executable, str(ROOT / "tests" / "heal_sender.py"), "--serve"], cwd=ROOT,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(*words) -> int:
        server.stdin.write(" ".join(map(str, words)) + "\n")
        server.stdin.flush()
        answer = server.stdout.readline()
        assert answer, f"the sender server exited with {server.wait()}"
        return int(answer)

    yield ask
    server.stdin.close()
    try:
        server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


@pytest.fixture
def heal_from(sender_server) -> Iterator[Callable[[str], Callable[[dict], int]]]:
    """``heal_from(scenario)``: starts the sender of ``scenario`` (a process of its own, forked by the sender server)
    and returns the receive of this process (rank 1), as ``heal.run`` runs it for a plan where process SOURCE heals
    this one."""
    senders: list[int] = []
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timedelta(seconds=60), wait_for_workers=False)

    def start(scenario: str) -> Callable[[dict], int]:
        senders.append(sender_server("send", store.port, scenario))
        dist.init_process_group("gloo", store=store, rank=1, world_size=2, timeout=timedelta(seconds=30))
        the_plan = heal.Plan(((SOURCE, 1),), 3)
        return lambda state: heal.run(the_plan, 1, {SOURCE: 0, 1: 1}, state, torch.device("cpu"))

    yield start
    store.set("done", b"1")
    for sender in senders:  # one still sending what this process refused to take is killed after a second
        sender_server("end", sender)
    if dist.is_initialized():
        dist.destroy_process_group()


def refusal(heal_from, scenario: str) -> str:
    """The message of the StateLost that receiving ``scenario``'s description raises."""
    receive = heal_from(scenario)
    with pytest.raises(StateLost) as refused:
        receive(fresh_state())
    message = str(refused.value)
    assert message.startswith(f"process {SOURCE} (rank 0)"), message
    return message


def test_an_optimizer_never_stepped_is_healed_with_its_peers_state(heal_from):
    state, expected = fresh_state(), survivor()
    received = heal_from("honest")(state)
    assert received == sum(t.numel() * t.element_size() for t in [*expected["model"].state_dict().values(), *(
        v for s in expected["optimizer"].state_dict()["state"].values() for v in s.values())])
    for name, value in expected["model"].state_dict().items():
        assert torch.equal(state["model"].state_dict()[name], value)
    for index, values in expected["optimizer"].state_dict()["state"].items():
        for key, value in values.items():
            assert torch.equal(state["optimizer"].state_dict()["state"][index][key], value), (index, key)


def test_a_4_tib_tensor_the_replacement_holds_smaller_is_refused_naming_both(heal_from):
    message = refusal(heal_from, "held-4tib")
    assert "model['0.weight'] as [1099511627776] float32 on cpu" in message
    assert "this process holds [8, 4] float32 on cpu" in message


def test_4_tib_of_optimizer_state_is_refused_beyond_its_parameter(heal_from):
    message = refusal(heal_from, "state-4tib")
    assert "optimizer['state'][0]['exp_avg'] as [1099511627776] float32 on cpu" in message
    assert "parameter 0 ([8, 4] float32 on cpu)" in message and "at most 32 elements" in message


def test_a_shape_whose_size_overflows_is_refused(heal_from):
    message = refusal(heal_from, "overflow")
    assert f"optimizer['state'][0]['exp_avg_sq'] as [{1 << 62}, {1 << 62}] float32 on cpu" in message


def test_a_cuda_tensor_is_refused_where_this_process_uses_the_cpu(heal_from):
    message = refusal(heal_from, "cuda")
    assert "model['0.weight'] as [8, 4] float32 on cuda" in message and "uses cpu" in message


def test_a_description_far_larger_than_this_process_state_is_refused_before_it_is_read(heal_from):
    message = refusal(heal_from, "many")
    assert "state description of" in message and "takes at most 1048576" in message


def test_more_tensors_than_this_process_can_take_are_refused_by_count(heal_from):
    message = refusal(heal_from, "more")
    assert "describes 116 tensors" in message and "holds 4" in message


def test_a_compressed_description_is_refused_before_it_is_unpacked(heal_from):
    message = refusal(heal_from, "bomb")
    assert "compressed" in message


def test_a_description_that_names_one_tensor_a_million_times_is_refused(heal_from):
    message = refusal(heal_from, "laughs")
    assert "more than" in message and "values" in message


def test_a_mark_naming_no_tensor_is_refused(heal_from):
    message = refusal(heal_from, "mark")
    assert "model['0.weight'] as tensor 1000000 of 16" in message
