"""Healing: a replacement process gets the state of its replica peers from a live one, over the process group.

After a group formed (the first start, or a recovery's), every process says whether it holds state (it has been
training: a survivor) or is fresh (it has just started: a replacement, or every process at the job's first start).
Each fresh process then receives, from a holder of the same replica set, every tensor and value of the state that
the program handed over (``Stateful`` objects: modules, optimizers, schedulers), and the step it is at. A replica set
is the processes that hold the same state: every process in data parallelism, the processes with the same shard
under sharding. Where every process is fresh nobody is healed (the job's start: the program loads its own
checkpoint if it has one); a fresh process whose replica set holds no survivor cannot be healed (``StateLost``).

The plan (who sends to whom) is pure and the same in every process, from the facts every process read off the
coordinator; the transfer is point-to-point sends on the default process group: a description of the state
(its structure and each tensor's shape and dtype, ``torch.save``'d and loaded with ``weights_only``: no code runs
on the receiver), then the tensors themselves: from the sender's own memory, and into the receiver's own tensors
where it has them alike (its parameters, buffers and optimizer state), so nothing is allocated or copied twice.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ifrt.client import Client
from ifrt.errors import InvalidArgument, StateLost

MAX_DESCRIPTION_BYTES = 256 << 20
"""The largest state description a receiver takes (not its tensors: their structure, shapes and dtypes)."""
TENSOR = "__ifrt_tensor__"
"""Marks where a tensor was in a state's description: (TENSOR, its index among the tensors sent)."""


class Stateful(Protocol):
    """What a replica keeps and a replacement receives: torch modules, optimizers and LR schedulers are."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


@dataclass(frozen=True)
class Standing:
    """What one process said after a group formed: whether it holds state, and at which step."""

    holds: bool
    step: int


@dataclass(frozen=True)
class Plan:
    """Who sends state to whom (pairs of process ids, in the order every process runs them), and the step the
    fresh processes take."""

    sends: tuple[tuple[int, int], ...]
    step: int


@dataclass(frozen=True)
class Healed:
    """How a fresh process was healed: who sent its state, the step it took, the tensor bytes it received and the
    seconds from the exchange's start to the state loaded."""

    source: int
    step: int
    bytes: int
    seconds: float

    def __str__(self) -> str:
        return (f"step {self.step} from process {self.source}: {self.bytes / 1e6:.1f} MB in {self.seconds:.2f}s "
                f"({self.bytes / 1e9 / max(self.seconds, 1e-9):.2f} GB/s)")


def plan(standings: Mapping[int, Standing], replica_set: Callable[[int], Sequence[int]]) -> Plan:
    """The healing of ``standings`` (process id -> what it said) where ``replica_set(p)`` is the processes holding
    the same state as ``p``. StateLost names a fresh process none of whose replicas holds state, or replicas that
    hold different steps."""
    holders = sorted(p for p, s in standings.items() if s.holds)
    if not holders:
        return Plan((), 0)  # the job's start, or a whole restart: nobody holds anything to send
    steps = {standings[p].step for p in holders}
    if len(steps) > 1:
        at = ", ".join(f"process {p} at step {standings[p].step}" for p in holders)
        raise StateLost(f"the processes that survived hold different steps ({at}): a step was kept by some and "
                        "not others; keep a step only where should_commit() said so")
    sends: list[tuple[int, int]] = []
    served: dict[tuple[int, ...], int] = {}  # replica set's holders -> fresh processes given a source so far
    for fresh in sorted(p for p, s in standings.items() if not s.holds):
        replicas = sorted(set(replica_set(fresh)) & standings.keys())
        sources = tuple(p for p in replicas if standings[p].holds)
        if not sources:
            raise StateLost(f"process {fresh}'s state has no live copy: its replica set {replicas} holds no process "
                            "that survived, so nothing can send it; restart the job from a checkpoint (or keep "
                            "more than one replica of every shard)")
        nth = served.get(sources, 0)  # spread the fresh processes of one replica set over its holders
        sends.append((sources[nth % len(sources)], fresh))
        served[sources] = nth + 1
    return Plan(tuple(sends), steps.pop())


def data_parallel(process_ids: Sequence[int]) -> Callable[[int], Sequence[int]]:
    """Every process holds the same state."""
    everyone = tuple(process_ids)
    return lambda _: everyone


def replica_sets(sets: Sequence[Sequence[int]]) -> Callable[[int], Sequence[int]]:
    """Each process holds the state of the other processes of its set (sets of process ids, disjoint); a process
    in no set is its own."""
    of: dict[int, tuple[int, ...]] = {}
    for members in sets:
        for p in members:
            if p in of:
                raise InvalidArgument(f"process {p} is in two replica sets ({list(of[p])} and {list(members)}): "
                                      "expected disjoint sets of process ids")
            of[p] = tuple(members)
    return lambda p: of.get(p, (p,))


def exchange(client: Client, scope: str, me: int, standing: Standing, timeout: float) -> dict[int, Standing]:
    """Every process's standing, read off the coordinator once all have written theirs (a barrier: a process that
    fails meanwhile fails it at once, naming it)."""
    client.kv_set(f"{scope}/heal/{me}", json.dumps({"holds": standing.holds, "step": standing.step}).encode(),
                  timeout=timeout)
    client.barrier(f"{scope}/heal", timeout)
    return {process_id: _standing(key, value) for key, value in client.kv_dir(f"{scope}/heal/", timeout=timeout).items()
            if (process_id := _process_id(key)) is not None}


def _process_id(key: str) -> int | None:
    name = key.rsplit("/", 1)[1]
    return int(name) if name.isdigit() else None


def _standing(key: str, value: bytes) -> Standing:
    """A process's standing as it wrote it; InvalidArgument naming the key if it is not one."""
    try:
        fields = json.loads(value)
        if isinstance(fields.get("holds"), bool) and type(fields.get("step")) is int and len(fields) == 2:
            return Standing(fields["holds"], fields["step"])
    except (ValueError, AttributeError):
        pass
    raise InvalidArgument(f"the healing record {key!r} is {value[:64]!r}: expected a JSON object "
                          '{"holds": true|false, "step": <int>} written by ifrt.torch.Replica')


def run(the_plan: Plan, me: int, rank_of: Mapping[int, int], state: Mapping[str, Stateful],
        device: torch.device) -> int:
    """This process's part of ``the_plan``: sends its state to each process it heals, or loads what it receives;
    returns the bytes it received."""
    received = 0
    for source, fresh in the_plan.sends:
        if source == me:
            send(state, rank_of[fresh], device)
        elif fresh == me:
            received += receive(state, rank_of[source], device)
    return received


def send(state: Mapping[str, Stateful], rank: int, device: torch.device) -> None:
    """Sends the state dicts of ``state`` to ``rank``: their description, then every tensor."""
    tensors: list[torch.Tensor] = []
    described = {name: _describe(obj.state_dict(), tensors) for name, obj in state.items()}
    specs = [(tuple(t.shape), str(t.dtype).removeprefix("torch."), t.device.type) for t in tensors]
    buffer = io.BytesIO()
    torch.save((described, specs), buffer)
    header = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    dist.send(torch.tensor([header.numel()], dtype=torch.int64, device=device), rank)
    dist.send(header.to(device), rank)
    for t in tensors:
        dist.send(t.detach().to(device).contiguous(), rank)


def receive(state: Mapping[str, Stateful], rank: int, device: torch.device) -> int:
    """Receives state dicts from ``rank`` and loads them into ``state`` (by name); returns the tensor bytes."""
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(size, rank)
    if not 0 < size.item() <= MAX_DESCRIPTION_BYTES:
        raise InvalidArgument(f"the state description rank {rank} sends is {int(size.item())} bytes: expected 1 to "
                              f"{MAX_DESCRIPTION_BYTES} (a structure and each tensor's shape and dtype)")
    header = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.recv(header, rank)
    described, specs = torch.load(io.BytesIO(header.cpu().numpy().tobytes()), weights_only=True)
    missing = sorted(set(described) ^ set(state))
    if missing:
        raise InvalidArgument(f"the state sent names {sorted(described)} and this process's {sorted(state)}: "
                              "expected the same names in every process")
    own = dict(_tensor_paths({name: obj.state_dict() for name, obj in state.items()}))
    into = {mark[1]: own.get(path) for path, mark in _tensor_paths(described)}
    tensors = []
    with torch.no_grad():
        for index, (shape, dtype, kind) in enumerate(specs):
            dtype_ = getattr(torch, str(dtype), None)
            if not isinstance(dtype_, torch.dtype) or not all(type(n) is int and n >= 0 for n in shape):
                raise InvalidArgument(f"tensor {index} of the state rank {rank} sends is described as {shape!r} of "
                                      f"{dtype!r}: expected a shape of sizes and a torch dtype")
            target = into.get(index)
            # straight into this process's own tensor where it has one alike (a parameter, a buffer, an optimizer's
            # state): no allocation, no copy when loaded
            if not (target is not None and target.shape == shape and target.dtype == dtype_ and kind == device.type
                    and target.device == device and target.is_contiguous()):
                target = torch.empty(shape, dtype=dtype_, device=device)
            dist.recv(target, rank)
            tensors.append(target if kind == device.type else target.to(_local(kind)))
    for name, obj in state.items():
        obj.load_state_dict(_rebuild(described[name], tensors))
    return sum(t.numel() * t.element_size() for t in tensors)


def _tensor_paths(value: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """(path of keys and indices, tensor or tensor mark) for every tensor in a state (or its description)."""
    if isinstance(value, torch.Tensor) or (isinstance(value, tuple) and len(value) == 2 and value[0] == TENSOR):
        yield path, value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _tensor_paths(v, (*path, k))
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            yield from _tensor_paths(v, (*path, i))


def _describe(value: Any, tensors: list[torch.Tensor]) -> Any:
    """``value`` with each tensor replaced by its mark (the tensor appended to ``tensors``)."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return (TENSOR, len(tensors) - 1)
    if isinstance(value, Mapping):
        return {k: _describe(v, tensors) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_describe(v, tensors) for v in value)
    return value


def _rebuild(value: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """The inverse of ``_describe``."""
    if isinstance(value, tuple) and len(value) == 2 and value[0] == TENSOR:
        return tensors[value[1]]
    if isinstance(value, dict):
        return {k: _rebuild(v, tensors) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_rebuild(v, tensors) for v in value)
    return value


def _local(kind: str) -> torch.device:
    """This process's device of a kind (its current CUDA device for ``cuda``)."""
    return torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)
