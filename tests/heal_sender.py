"""The sending side of tests/test_heal_description.py: rank 0 of a 2-rank gloo group on loopback, on the TCP store
at ``argv[1]`` (port). It trains a small model one Adam step (a survivor's state) and sends the description of that
state and then its tensors to rank 1, as ``ifrt.torch.heal.send`` does; ``argv[2]`` names how the description is
altered first (``honest``: not at all, sent by ``send`` itself).

With ``--serve`` it is a server of such senders (importing torch costs a process seconds of CPU; a fork of one that
has it costs little): each line ``send PORT SCENARIO`` on its standard input forks a sender process, whose pid it
answers; ``end PID`` gives that sender a second to leave, kills it if it has not, and answers its exit status.
"""

from __future__ import annotations

import importlib
import io
import os
import select
import signal
import sys
import zipfile
from datetime import timedelta

import torch
import torch.distributed as dist

from ifrt.torch import heal
from ifrt.torch.heal import TENSOR

TIB = 1 << 40


def survivor() -> dict:
    """The state a survivor holds: the model the tests build, after one Adam step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    torch.nn.functional.mse_loss(model(torch.randn(16, 4)), torch.randn(16, 1)).backward()
    optimizer.step()
    return {"model": model, "optimizer": optimizer}


def index_of(described: dict, *path) -> int:
    """The tensor index a description's mark at ``path`` names."""
    value = described
    for key in path:
        value = value[key]
    return value[1]


def altered(scenario: str, described: dict, specs: list) -> bytes:
    """The description of ``scenario``, as the bytes sent."""
    def extra(tensors):  # tensors the survivor does not have, under parameter 0's Adam state
        marks = []
        for spec in tensors:
            marks.append((TENSOR, len(specs)))
            specs.append(spec)
        return marks

    if scenario == "held-4tib":
        specs[index_of(described, "model", "0.weight")] = ((TIB,), "float32", "cpu")
    elif scenario == "state-4tib":
        specs[index_of(described, "optimizer", "state", 0, "exp_avg")] = ((TIB,), "float32", "cpu")
    elif scenario == "overflow":
        specs[index_of(described, "optimizer", "state", 0, "exp_avg_sq")] = ((1 << 62, 1 << 62), "float32", "cpu")
    elif scenario == "cuda":
        specs[index_of(described, "model", "0.weight")] = ((8, 4), "float32", "cuda")
    elif scenario == "many":
        described["optimizer"]["state"][0]["extra"] = extra([((), "float32", "cpu")] * 200_000)
    elif scenario == "more":
        described["optimizer"]["state"][0]["extra"] = extra([((), "float32", "cpu")] * 100)
    elif scenario == "laughs":  # 2**20 paths to one mark, in a few hundred bytes
        nest = extra([((), "float32", "cpu")])
        for _ in range(20):
            nest = [nest, nest]
        described["optimizer"]["state"][0]["extra"] = nest
    elif scenario == "mark":
        described["model"]["0.weight"] = (TENSOR, 10**6)
    buffer = io.BytesIO()
    if scenario == "bomb":  # 64 MiB of description deflated into a few dozen KiB
        described["optimizer"]["param_groups"][0]["note"] = "x" * (64 << 20)
        torch.save((described, specs), buffer)
        plain, buffer = zipfile.ZipFile(io.BytesIO(buffer.getvalue())), io.BytesIO()
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as packed:
            for entry in plain.infolist():
                packed.writestr(entry.filename, plain.read(entry))
        return buffer.getvalue()
    torch.save((described, specs), buffer)
    return buffer.getvalue()


def send(port: int, scenario: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=0, world_size=2, timeout=timedelta(seconds=30))
    state = survivor()
    if scenario == "honest":
        heal.send(state, 1, torch.device("cpu"))
    else:
        tensors: list[torch.Tensor] = []
        described = {name: heal._describe(obj.state_dict(), tensors) for name, obj in state.items()}
        specs = [(tuple(t.shape), str(t.dtype).removeprefix("torch."), t.device.type) for t in tensors]
        header = torch.frombuffer(bytearray(altered(scenario, described, specs)), dtype=torch.uint8)
        dist.send(torch.tensor([header.numel()], dtype=torch.int64), 1)
        dist.send(header, 1)
        for t in tensors:  # what a sender holds; a receiver that refused the description takes none of it
            dist.send(t.detach().contiguous(), 1)
    store.wait(["done"])  # the receiver's verdict is in: leave


def forked(port: int, scenario: str) -> int:
    """A sender of ``scenario`` forked from this process; its pid."""
    pid = os.fork()
    if pid:
        return pid
    status = 0
    try:
        sys.stdin.close()
        os.dup2(2, 1)  # the server's standard output carries its answers alone: a sender's output goes to stderr
        sys.stdout = sys.stderr
        send(port, scenario)
    except BaseException:
        import traceback

        traceback.print_exc()
        status = 1
    finally:
        sys.stderr.flush()
        os._exit(status)


def ended(pid: int, grace: float = 1.0) -> int:
    """Waits ``grace`` seconds for sender ``pid`` to leave, kills it if it has not; its exit status."""
    handle = os.pidfd_open(pid)
    try:
        if not select.select([handle], [], [], grace)[0]:  # still sending what the receiver refused to take
            os.kill(pid, signal.SIGKILL)
    finally:
        os.close(handle)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def serve() -> None:
    # What each sender would import on its own, once here: torch.optim's first optimizer imports torch._dynamo
    # (1.7 s of CPU; it starts no thread).
    importlib.import_module("torch._dynamo")
    for line in sys.stdin:
        command, *args = line.split()
        if command == "send":
            answer = forked(int(args[0]), args[1])
        elif command == "end":
            answer = ended(int(args[0]))
        else:
            raise ValueError(f"unknown command {line!r}")
        print(answer, flush=True)


def main() -> None:
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        send(int(sys.argv[1]), sys.argv[2])


if __name__ == "__main__":
    main()
