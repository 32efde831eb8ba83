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

The receiver checks the description against its own state before it allocates anything (a replacement builds the
same model, so its fresh state has the same structure): a tensor it holds must be described alike; one it does not
hold (an optimizer's state before its first step) is bounded by its own, no larger than the parameter it is the
state of (or elsewhere than its largest tensor); the description's size and tensor count are bounded by its own; a
device kind it does not use is refused. Each refusal is one StateLost naming the peer, the tensor's path and both
descriptions.
"""

from __future__ import annotations

import io
import json
import math
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ifrt.client import Client
from ifrt.errors import InvalidArgument, StateLost

MAX_DESCRIPTION_BYTES = 64 << 20
"""The largest state description any receiver takes (not its tensors: their structure, shapes and dtypes): a
10,000-parameter model with Adam's state describes itself in 2.9 MB, 100,000 parameters in about 29 MB."""
MIN_DESCRIPTION_LIMIT = 1 << 20
"""The description a receiver takes however small its own state."""
DESCRIPTION_GROWTH = 8
"""A receiver takes a description up to this many times the size of its own state's: a survivor's optimizer holds
state a replacement's lacks until its first step (Adam's makes a 1,000-parameter model's 289 KB from 103 KB, 350 KB
with amsgrad)."""
STATE_TENSORS_PER_PARAMETER = 8
"""The tensors of an optimizer's state of one parameter a receiver takes where it holds none (Adam keeps 3, with
amsgrad 4)."""
MAX_DEPTH = 64
"""How deeply a state's description may nest."""
MAX_DIMS = 64
"""The most dimensions a described tensor may have."""
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


def exchange(client: Client, scope: str, me: int, standing: Standing, timeout: float,
             process_ids: Sequence[int] | None = None) -> dict[int, Standing]:
    """Every process's standing (of ``process_ids``, default: the topology's), read off the coordinator once all
    have written theirs (a barrier: a process that fails meanwhile fails it at once, naming it)."""
    client.kv_set(f"{scope}/heal/{me}", json.dumps({"holds": standing.holds, "step": standing.step}).encode(),
                  timeout=timeout)
    client.barrier(f"{scope}/heal", timeout, process_ids)
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
                          '{"holds": true|false, "step": <int>} written by ifrt.torch.Healing')


def run(the_plan: Plan, me: int, rank_of: Mapping[int, int], state: Mapping[str, Stateful],
        device: torch.device) -> int:
    """This process's part of ``the_plan``: sends its state to each process it heals, or loads what it receives;
    returns the bytes it received."""
    received = 0
    for source, fresh in the_plan.sends:
        if source == me:
            send(state, rank_of[fresh], device)
        elif fresh == me:
            received += receive(state, rank_of[source], device, source)
    return received


def send(state: Mapping[str, Stateful], rank: int, device: torch.device) -> None:
    """Sends the state dicts of ``state`` to ``rank``: their description, then every tensor."""
    tensors: list[torch.Tensor] = []
    described = {name: _describe(obj.state_dict(), tensors) for name, obj in state.items()}
    buffer = io.BytesIO()
    torch.save((described, [_spec(t) for t in tensors]), buffer)
    header = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    dist.send(torch.tensor([header.numel()], dtype=torch.int64, device=device), rank)
    dist.send(header.to(device), rank)
    for t in tensors:
        dist.send(t.detach().to(device).contiguous(), rank)


def receive(state: Mapping[str, Stateful], rank: int, device: torch.device, source: int | None = None) -> int:
    """Receives state dicts from ``rank`` (process ``source``) and loads them into ``state`` (by name); returns the
    tensor bytes. The description is checked against this process's own state before anything is allocated for it:
    StateLost names the peer, the tensor and both descriptions."""
    peer = f"process {source} (rank {rank})" if source is not None else f"rank {rank}"
    holdings = _Holdings.of(state, device)
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(size, rank)
    limit = holdings.description_limit()
    if not 0 < size.item() <= limit:
        raise StateLost(f"{peer} sends a state description of {int(size.item())} bytes: this process takes at most "
                        f"{limit} ({DESCRIPTION_GROWTH} times its own description's {holdings.description_bytes}, at "
                        f"least {MIN_DESCRIPTION_LIMIT}, at most MAX_DESCRIPTION_BYTES {MAX_DESCRIPTION_BYTES}); "
                        "a replacement builds the same model, so its own state's description is about the size of "
                        "its peer's")
    header = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.recv(header, rank)
    described, specs = _load(header.cpu().numpy().tobytes(), peer, state)
    slots = _slots(described, specs, holdings, peer, device, budget=2 * int(size.item()) + 1000)
    tensors = []
    with torch.no_grad():
        for shape, dtype, into, place in slots:
            # straight into this process's own tensor where it has one alike (a parameter, a buffer, an optimizer's
            # state): no allocation, no copy when loaded
            target = into if into is not None else torch.empty(shape, dtype=dtype, device=device)
            dist.recv(target, rank)
            tensors.append(target if target.device == place else target.to(place))
    for name, obj in state.items():
        obj.load_state_dict(_rebuild(described[name], tensors))
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class _Holdings:
    """What this process holds, which a peer's description is checked against: its tensors by path in its state,
    its optimizers' parameters by (name, index in the optimizer's state), the device kinds it uses, and the size of
    its own state's description."""

    tensors: Mapping[tuple, torch.Tensor]
    parameters: Mapping[tuple[str, Any], torch.Tensor]
    kinds: frozenset[str]
    description_bytes: int

    @classmethod
    def of(cls, state: Mapping[str, Stateful], device: torch.device) -> _Holdings:
        dicts = {name: obj.state_dict() for name, obj in state.items()}
        tensors = {path: t for path, t in _tensor_paths(dicts) if not torch.nn.parameter.is_lazy(t)}
        parameters = {}
        for name, obj in state.items():
            if isinstance(obj, torch.optim.Optimizer):
                groups = dicts[name].get("param_groups", ())
                for group, held in zip(groups, obj.param_groups, strict=False):
                    for index, p in zip(group.get("params", ()), held["params"], strict=False):
                        if not torch.nn.parameter.is_lazy(p):
                            parameters[(name, index)] = p
        own: list[torch.Tensor] = []
        buffer = io.BytesIO()
        torch.save(({name: _describe(d, own) for name, d in dicts.items()}, [_spec(t) for t in own]), buffer)
        kinds = frozenset({"cpu", device.type, *(t.device.type for t in tensors.values())})
        return cls(tensors, parameters, kinds, len(buffer.getvalue()))

    def description_limit(self) -> int:
        """The largest description this process takes."""
        return min(MAX_DESCRIPTION_BYTES, max(MIN_DESCRIPTION_LIMIT, DESCRIPTION_GROWTH * self.description_bytes))

    def most_tensors(self) -> int:
        """The most tensors a description may hold: those this process holds, as many more it does not hold, and
        STATE_TENSORS_PER_PARAMETER of optimizer state for each parameter."""
        return 2 * len(self.tensors) + STATE_TENSORS_PER_PARAMETER * len(self.parameters)

    def largest(self) -> int:
        """The elements of this process's largest tensor."""
        return max((t.numel() for t in (*self.tensors.values(), *self.parameters.values())), default=0)


def _load(blob: bytes, peer: str, state: Mapping[str, Stateful]) -> tuple[dict, Sequence]:
    """A peer's description as ``torch.load(weights_only=True)`` reads it, from an archive of stored entries only
    (torch.save compresses none, and a compressed one could unpack to any size): what is read is never larger than
    what was received. StateLost says why where it is not one."""
    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as archive:
            entries = archive.infolist()
            packed = [e.filename for e in entries if e.compress_type != zipfile.ZIP_STORED]
            if packed:
                raise StateLost(f"{peer}'s state description holds compressed entries ({_short(repr(packed))}): "
                                "torch.save stores its entries as they are, and a compressed one could unpack to any "
                                "size; nothing of it was unpacked")
            if sum(e.file_size + e.compress_size for e in entries) > 2 * len(blob):
                raise StateLost(f"{peer}'s state description of {len(blob)} bytes names {len(entries)} entries "
                                "larger than itself together: expected what torch.save writes")
            plain = io.BytesIO()  # the entries read, and nothing else, for torch.load to read
            with zipfile.ZipFile(plain, "w", zipfile.ZIP_STORED) as copy:
                for entry in entries:
                    copy.writestr(entry.filename, archive.read(entry))
        loaded = torch.load(io.BytesIO(plain.getvalue()), weights_only=True)
    except StateLost:
        raise
    except Exception as e:  # anything unreadable: the peer sent what send() never writes
        raise StateLost(f"{peer}'s state description of {len(blob)} bytes cannot be read ({type(e).__name__}: "
                        f"{_short(str(e), 200)}): expected what ifrt.torch.heal.send writes") from e
    if not (isinstance(loaded, tuple) and len(loaded) == 2 and isinstance(loaded[0], dict)
            and isinstance(loaded[1], list | tuple)):
        raise StateLost(f"{peer}'s state description is a {type(loaded).__name__}: expected (the state dicts by "
                        "name, each tensor's shape, dtype and device kind)")
    described, specs = loaded
    if set(described) != set(state):
        raise StateLost(f"{peer} describes the state {_short(repr(sorted(map(repr, described))), 200)} and this "
                        f"process holds {sorted(state)}: expected the same names in every process")
    return described, specs


def _slots(described: dict, specs: Sequence, holdings: _Holdings, peer: str, device: torch.device,
           budget: int) -> list[tuple[tuple[int, ...], torch.dtype, torch.Tensor | None, torch.device]]:
    """Each described tensor's shape, dtype, the tensor of this process to receive it into (or None: a new one)
    and the device it is placed on, once every one was checked against ``holdings``; StateLost names the first
    that does not fit, before anything is allocated."""
    if len(specs) > holdings.most_tensors():
        raise StateLost(f"{peer} describes {len(specs)} tensors: this process holds {len(holdings.tensors)} and takes "
                        f"at most {holdings.most_tensors()} (its own, as many it does not hold, and "
                        f"{STATE_TENSORS_PER_PARAMETER} of optimizer state for each of its {len(holdings.parameters)} "
                        "parameters)")
    paths: dict[int, tuple] = {}
    for path, index in _marks(described, peer, budget):
        if type(index) is not int or not 0 <= index < len(specs) or index in paths:
            raise StateLost(f"{peer} describes {_where(path)} as tensor {_short(repr(index))} of {len(specs)}: "
                            f"expected each index of 0 to {len(specs) - 1} once")
        paths[index] = path
    if len(paths) != len(specs):
        raise StateLost(f"{peer} describes {len(specs)} tensors and places {len(paths)} of them in its state: expected "
                        "each in one place")
    slots = []
    tally: dict[tuple, int] = {}  # tensors taken that this process does not hold: by its parameter, or () for others
    largest = holdings.largest()
    for index, spec in enumerate(specs):
        path = paths[index]
        shape, dtype, kind = _spec_of(spec, peer, path)
        said = f"{peer} describes {_where(path)} as {list(shape)} {_dtype(dtype)} on {_short(kind, 40)}"
        if kind not in holdings.kinds:
            raise StateLost(f"{said}: this process has no such device to place it on (it uses "
                            f"{', '.join(sorted(holdings.kinds))}: its process group's device and its state's)")
        own = holdings.tensors.get(path)
        if own is not None:
            if tuple(own.shape) != shape or own.dtype != dtype:
                raise StateLost(f"{said}, and this process holds {_said(own)}: a replacement builds the same model, "
                                "so a tensor it holds is described alike; nothing was allocated")
            slots.append((shape, dtype, own if own.device == device and own.is_contiguous() else None, own.device))
            continue
        numel = math.prod(shape)
        # an optimizer's state of a parameter: path (optimizer's name, "state", parameter's index, ...)
        parameter = holdings.parameters.get((path[0], path[2])) if len(path) > 3 and path[1] == "state" else None
        key = (path[0], path[2]) if parameter is not None else ()
        tally[key] = tally.get(key, 0) + 1
        if parameter is not None and (numel > parameter.numel() or tally[key] > STATE_TENSORS_PER_PARAMETER):
            raise StateLost(f"{said}, which this process does not hold: as state of its parameter {path[2]} "
                            f"({_said(parameter)}) it takes at most {parameter.numel()} elements, and "
                            f"{STATE_TENSORS_PER_PARAMETER} tensors a parameter; nothing was allocated")
        if parameter is None and (numel > largest or tally[key] > len(holdings.tensors)):
            raise StateLost(f"{said}, which this process does not hold: outside an optimizer's state of its "
                            f"parameters it takes at most {len(holdings.tensors)} such tensors (as many as it holds), "
                            f"each of at most {largest} elements (its largest); nothing was allocated")
        slots.append((shape, dtype, None, _local(kind)))
    return slots


def _marks(described: dict, peer: str, budget: int) -> list[tuple[tuple, Any]]:
    """(path, index) of every tensor mark of a peer's description, visiting at most ``budget`` values (a structure
    shared over and over describes more paths than its bytes) and MAX_DEPTH levels."""
    found: list[tuple[tuple, Any]] = []
    visits = 0

    def walk(value: Any, path: tuple) -> None:
        nonlocal visits
        visits += 1
        if visits > budget:
            raise StateLost(f"{peer}'s state description names more than {budget} values in {_where(path)} and "
                            "before (twice its bytes): a structure shared over and over; nothing was allocated")
        if len(path) > MAX_DEPTH:
            raise StateLost(f"{peer}'s state description nests deeper than {MAX_DEPTH} levels at {_where(path)}")
        if isinstance(value, tuple) and len(value) == 2 and value[0] == TENSOR:
            found.append((path, value[1]))
        elif isinstance(value, Mapping):
            for k, v in value.items():
                walk(v, (*path, k))
        elif isinstance(value, list | tuple):
            for i, v in enumerate(value):
                walk(v, (*path, i))

    walk(described, ())
    return found


def _spec_of(spec: Any, peer: str, path: tuple) -> tuple[tuple[int, ...], torch.dtype, str]:
    """A peer's (shape, dtype, device kind) of one tensor, checked for form."""
    shape = dtype = kind = None
    if isinstance(spec, list | tuple) and len(spec) == 3:
        shape, dtype, kind = spec
    dtype_ = getattr(torch, dtype, None) if isinstance(dtype, str) else None
    if not (isinstance(shape, list | tuple) and len(shape) <= MAX_DIMS and all(type(n) is int and n >= 0 for n in shape)
            and isinstance(dtype_, torch.dtype) and isinstance(kind, str)):
        raise StateLost(f"{peer} describes {_where(path)} as {_short(repr(spec))}: expected a shape of at most "
                        f"{MAX_DIMS} sizes, a torch dtype and a device kind")
    return tuple(shape), dtype_, kind


def _spec(t: torch.Tensor) -> tuple[tuple[int, ...], str, str]:
    """How a tensor is described: its shape (none for a parameter not yet initialized), dtype and device kind."""
    shape = () if torch.nn.parameter.is_lazy(t) else tuple(t.shape)
    return shape, _dtype(t.dtype), t.device.type


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _said(t: torch.Tensor) -> str:
    """A tensor of this process as a peer's is described in messages."""
    return f"{list(t.shape)} {_dtype(t.dtype)} on {t.device.type}"


def _where(path: tuple) -> str:
    """A tensor's path in the state: ``optimizer['state'][0]['exp_avg']``."""
    if not path:
        return "the state"
    return _short(str(path[0]) + "".join(f"[{_short(repr(k), 60)}]" for k in path[1:]), 300)


def _short(text: str, most: int = 80) -> str:
    return text if len(text) <= most else text[:most] + "..."


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
