"""torchrun's rendezvous state is read back without running anything, in linear time (ifrt/torchrun/state.py):
states torch makes pass, anything else is refused as RendezvousStateError naming the key and what was found (states
built to cost quadratic time or huge integers included, in well under a second); torch's state holder, reading
through the check against a real coordinator, never unpickles a pickle planted at the state key."""

from __future__ import annotations

import os
import pickle
import re
import time
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.elastic.rendezvous.api import RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousSettings,
    RendezvousTimeout,
    _BackendRendezvousStateHolder,
    _NodeDesc,
    _NodeDescGenerator,
    _RendezvousState,
)

import ifrt
from ifrt.torchrun.backend import KEY_PREFIX, IfrtRendezvousBackend, host_entry
from ifrt.torchrun.opcodes import MAX_INT_BYTES, MAX_TUPLE_DEPTH
from ifrt.torchrun.state import (
    MAX_NODES,
    MAX_SAME_HASH,
    CheckedStateBackend,
    check_state,
    check_torch_layout,
)

KEY = f"{KEY_PREFIX}job/state"
MODULE = _RendezvousState.__module__.encode()


class WritesMarker:
    """Unpickled, it writes a file: what an attacker's pickle would do with os.system."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def torch_state(nodes: int) -> _RendezvousState:
    """A state as torch's own operations leave it: a complete round of ``nodes`` nodes, one waiting, heartbeats."""
    generate = _NodeDescGenerator()
    state = _RendezvousState()
    members = [generate.generate(f"10.0.{i // 256}.{i % 256}") for i in range(nodes + 1)]
    state.round, state.complete = 3, True
    state.deadline = datetime.now(UTC) + timedelta(seconds=30)
    state.participants = {node: rank for rank, node in enumerate(members[:-1])}
    state.wait_list = {members[-1]}
    state.last_heartbeats = {node: datetime.now(UTC) for node in members}
    return state


def refusal(data: bytes, max_nodes: int | None = None) -> str:
    with pytest.raises(RendezvousStateError) as caught:
        check_state(data, KEY, max_nodes)
    message = str(caught.value)
    assert KEY in message and "Nothing in it was run" in message, message
    return message


def short_str(text: bytes) -> bytes:
    return b"\x8c" + bytes([len(text)]) + text


def global_(module: bytes, name: bytes) -> bytes:
    return short_str(module) + short_str(name) + b"\x93"


@pytest.mark.parametrize("nodes", [0, 2, 1000])
@pytest.mark.parametrize("protocol", [pickle.DEFAULT_PROTOCOL, pickle.HIGHEST_PROTOCOL])
def test_states_torch_makes_pass_unchanged(nodes, protocol):
    state = torch_state(nodes) if nodes else _RendezvousState()
    checked = check_state(pickle.dumps(state, protocol=protocol), KEY)
    assert type(checked) is _RendezvousState and vars(checked) == vars(state)


def test_a_pickle_that_runs_a_command_is_refused_naming_the_class_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    message = refusal(pickle.dumps(WritesMarker(marker)))
    assert f"it names {os.system.__module__}.system, which is no class of torch's rendezvous state" in message
    state = torch_state(2)
    state.participants[next(iter(state.participants))] = WritesMarker(marker)  # deep inside a real state
    assert f"{os.system.__module__}.system" in refusal(pickle.dumps(state))
    assert not marker.exists()


def test_a_name_read_from_the_bytes_reaches_the_message_escaped():
    forged = b"\x80\x04" + global_(b"os\n\x1b[31mFAKE", "system\u202e".encode()) + b"."
    message = refusal(forged)
    assert "it names 'os\\n\\x1b[31mFAKE'.'system\\u202e', which is no class" in message
    assert "\x1b" not in message and "\n" not in message and "\u202e" not in message


def test_a_class_of_torchs_own_module_outside_the_state_is_refused():
    settings_class = pickle.dumps(RendezvousSettings)
    assert f"{RendezvousSettings.__module__}.RendezvousSettings, which is no class" in refusal(settings_class)


def test_tuples_nested_deeper_than_a_state_has_are_refused_before_loading():
    # One byte per level; loading it and hashing the result (as a node in a set would) overflows the C stack.
    bomb = b"\x80\x04)" + b"\x85" * 1_000_000 + b"."
    assert f"it nests tuples more than {MAX_TUPLE_DEPTH} deep" in refusal(bomb)


def test_a_pickle_that_sets_attributes_on_a_class_is_refused():
    # BUILD with a slot-state on the class _NodeDesc would setattr on torch's class itself in the agent.
    on_class = (b"\x80\x04" + global_(MODULE, b"_NodeDesc") + b"N}" + short_str(b"pid") + b"K\x01s\x86b.")
    assert "its BUILD at byte" in refusal(on_class)


@pytest.mark.parametrize("data, found", [
    (b"\x80\x04K\x01\x82\x01.", "the opcode EXT1"),  # the extension registry
    (b"(i" + MODULE + b"\n_NodeDesc\n.", "the opcode INST"),  # protocol 0's instance, which calls its class
    (b"\x80\x04P0\n.", "the opcode PERSID"),
    (b"\x80\x04Nr\x00\x00\x00\x80.", "its LONG_BINPUT at byte 3 skips to memo 2147483648"),  # a 32 GiB memo table
    (b"\x80\x04K\x01)R.", "its REDUCE at byte 5 calls something other than a class it names"),
])
def test_opcodes_no_state_uses_are_refused(data, found):
    assert found in refusal(data)


@pytest.mark.parametrize("value, found", [
    (b"s1", "its SETITEM at byte 0 takes more than the stack holds"),
    (pickle.dumps(_RendezvousState())[:-5], "no well-formed pickle"),
    (pickle.dumps({"round": 1}), "it holds a dict, not torch's _RendezvousState"),
    (b"", "no well-formed pickle"),
    (b"\x80\x04" + global_(b"datetime", b"datetime") + b"\x8a\x09" + (2**70).to_bytes(9, "little") + b"\x85R.",
     f"its LONG1 at byte 23 is an integer of 9 bytes: a state holds none longer than {MAX_INT_BYTES}"),
    (pickle.dumps(_RendezvousState()) + b"N.", "it goes on for 2 bytes after its STOP"),
])
def test_bytes_that_are_no_state_are_refused(value, found):
    assert found in refusal(value)


def test_a_state_of_the_wrong_shape_is_refused_naming_the_field():
    state = torch_state(2)
    state.round = "3"
    assert "its field 'round' holds str, expected an int from 0 to" in refusal(pickle.dumps(state))
    state = torch_state(2)
    state.wait_list = {_NodeDesc(("10.0.0.1",), 1, 0)}
    assert "a _NodeDesc of its field 'wait_list' has an addr that is no string" in refusal(pickle.dumps(state))
    state = torch_state(2)
    state.participants[next(iter(state.participants))] = 7
    assert "a rank in its field 'participants' holds the int 7, expected an int from 0 to 1" in refusal(
        pickle.dumps(state), max_nodes=2)
    assert "its field 'participants' holds 2 nodes, more than the job's 1 (--nnodes)" in refusal(
        pickle.dumps(state), max_nodes=1)
    state = torch_state(2)
    deadline = state.deadline.__reduce__()[1][0]  # its 10 bytes; month 13
    data = pickle.dumps(state).replace(deadline, deadline[:2] + b"\x0d" + deadline[3:], 1)
    assert "a datetime of its field 'deadline' does not load as one (ValueError: month must be in 1..12)" in refusal(
        data)
    data = pickle.dumps(state).replace(deadline, deadline[:4] + b"\x63" + deadline[5:], 1)  # hour 99
    assert "does not load as one (ValueError: hour must be in 0..23)" in refusal(data)


def test_a_state_of_a_torch_of_another_layout_is_named_as_such_with_this_torchs_version():
    state = torch_state(2)
    state.extra = 1  # a field of a future torch
    message = refusal(pickle.dumps(state))
    assert f"its field 'extra' is no field of torch {torch.__version__}'s _RendezvousState (round, " in message
    assert f"an agent of another torch than this one ({torch.__version__}) wrote it" in message
    del state.extra, state.closed
    assert f"it lacks the field 'closed' of torch {torch.__version__}'s _RendezvousState" in refusal(
        pickle.dumps(state))


@pytest.mark.parametrize("protocol", [2, 3, 6])
def test_a_pickle_of_a_protocol_torch_does_not_write_is_refused_naming_the_protocols_read(protocol):
    data = pickle.dumps(torch_state(2), protocol=protocol) if protocol < 6 else b"\x80\x06N."
    assert f"it is a pickle of protocol {protocol}; ifrt reads protocols 4 and 5" in refusal(data)


def test_an_installed_torch_of_another_layout_is_named_when_the_handler_is_made(monkeypatch):
    check_torch_layout()  # the installed torch: known
    init = _RendezvousState.__init__

    def future_init(self) -> None:
        init(self)
        self.epoch = 0

    monkeypatch.setattr(_RendezvousState, "__init__", future_init)
    with pytest.raises(RendezvousStateError, match=re.escape(
            f"does not know the rendezvous state of torch {torch.__version__} (_RendezvousState.epoch is new)")):
        CheckedStateBackend(IfrtRendezvousBackend(None, KEY), KEY)


# States made to cost an agent time: each is answered (a state or a refusal) in well under a second of CPU.
def raw_state(pids: Iterable[int], local_ids: Iterable[int] | None = None) -> bytes:
    """torch's state with one participant per pid, all on one address, as the opcodes pickle.dumps writes, written
    here: making it of torch's objects would hash every node, quadratic for nodes that collide in the test itself."""
    memo = [global_(MODULE, b"_NodeDesc"), short_str(b"addr"), short_str(b"10.0.0.1"), short_str(b"pid"),
            short_str(b"local_id")]  # memo 0 to 4, each pushed, memoized and popped
    out = [b"\x80\x04", *(item + b"\x940" for item in memo), global_(MODULE, b"_RendezvousState"), b")\x81}(",
           short_str(b"round"), b"K\x03", short_str(b"complete"), b"\x89", short_str(b"deadline"), b"N",
           short_str(b"closed"), b"\x89", short_str(b"participants"), b"}("]
    for pid, local_id in zip(pids, local_ids if local_ids is not None else range(10**9), strict=False):
        pid_op = b"J" + pid.to_bytes(4, "little") if pid < 2**31 else b"\x8a" + bytes(
            [len(pickle.encode_long(pid))]) + pickle.encode_long(pid)
        out.append(b"h\x00)\x81}(h\x01h\x02h\x03" + pid_op + b"h\x04J" + local_id.to_bytes(4, "little") + b"ubK\x00")
    out += [b"u", short_str(b"wait_list"), b"\x8f", short_str(b"redundancy_list"), b"\x8f",
            short_str(b"last_heartbeats"), b"}ub."]
    return b"".join(out)


def cpu_seconds(data: bytes, max_nodes: int | None = None) -> tuple[float, str]:
    """The CPU time check_state takes for ``data``, and its refusal ("" for a state it accepts)."""
    started = time.process_time()
    try:
        check_state(data, KEY, max_nodes)
        found = ""
    except RendezvousStateError as e:
        found = str(e)
    return time.process_time() - started, found


def test_the_raw_state_is_the_state_pickle_makes():
    state = pickle.loads(raw_state([11, 12], [0, 1]))
    assert vars(check_state(raw_state([11, 12], [0, 1]), KEY)) == vars(state)
    assert list(state.participants) == [_NodeDesc("10.0.0.1", 11, 0), _NodeDesc("10.0.0.1", 12, 1)]


def test_nodes_whose_hashes_all_collide_are_answered_in_linear_time():
    # hash(k * (2**61 - 1)) is 0 for every k: before, each node's insert compared it with every earlier one (4,000
    # nodes: 2.5-6.5 s of CPU, in every agent on every read).
    data = raw_state((k * (2**61 - 1) for k in range(1, 4001)), [0] * 4000)  # one address, local_id 0: one hash
    seconds, found = cpu_seconds(data)
    assert seconds < 0.1, seconds
    assert f"is an integer of 9 bytes: a state holds none longer than {MAX_INT_BYTES}" in found  # k = 5


def test_nodes_sharing_one_hash_are_refused_before_any_set_of_them_is_built(monkeypatch):
    monkeypatch.setattr(_NodeDesc, "__hash__", lambda self: 0)  # what no seed gives an attacker, here by force
    seconds, found = cpu_seconds(raw_state(range(1, 8001)), max_nodes=8000)  # before: 5.6 s of CPU here
    assert seconds < 1.0, seconds
    assert f"more than {MAX_SAME_HASH} of its 8000 nodes share one hash" in found
    seconds, found = cpu_seconds(raw_state(range(1, 1 + MAX_SAME_HASH)))  # a few may: they cost little
    assert found == ""


def test_more_nodes_than_the_bound_are_refused_as_they_are_read():
    data = raw_state(range(1, 33_001))
    assert len(data) < 2**20  # within the coordinator's values
    seconds, found = cpu_seconds(data)
    assert seconds < 0.5, seconds
    assert f"it holds more than {MAX_NODES} _NodeDesc (at byte" in found
    assert f"more than {4 * 5000} _NodeDesc" in cpu_seconds(data, max_nodes=5000)[1]  # 4 x the job's, when more
    seconds, found = cpu_seconds(raw_state(range(1, 4001)), max_nodes=4000)
    assert found == "" and seconds < 1.0, seconds


def test_a_round_of_4_MiB_is_refused_before_the_integer_is_built():
    state = _RendezvousState()
    state.round = 1 << (8 * 4 * 2**20 - 2)
    data = pickle.dumps(state)
    seconds, found = cpu_seconds(data)
    assert seconds < 0.05, seconds
    assert "its LONG4 at byte" in found and "is an integer of 4194304 bytes" in found


def test_a_nodes_host_entry_that_is_not_what_agents_publish_is_refused_naming_the_key():
    assert host_entry("torchrun/job/hosts/n", b'{"hostname": "h", "address": "10.0.0.1"}').address == "10.0.0.1"
    for raw in (b"[" * 100_000, b'{"hostname": 1, "address": "a"}', b"\xff"):
        with pytest.raises(RendezvousStateError, match="refused the node's host at 'torchrun/job/hosts/n'"):
            host_entry("torchrun/job/hosts/n", raw)


# Random opcodes, and a real state with bytes flipped, inserted or removed: whatever the bytes, the check answers
# (a state or RendezvousStateError) in this process, which neither crashes nor hangs nor runs anything.
PIECES = [b"(", b")", b"\x85", b"\x86", b"\x87", b"t", b"}", b"]", b"\x8f", b"\x91", b"N", b"\x88", b"K\x01",
          short_str(b"addr"), b"\x94", b"h\x00", b"h\x01", b"2", b"0", b"1", b"b", b"R", b"\x81", b"s", b"u", b"a",
          b"e", b"\x90", b"l", b"d", global_(MODULE, b"_NodeDesc"), global_(MODULE, b"_RendezvousState"),
          global_(b"datetime", b"timezone"), global_(b"builtins", b"eval"), b"C\x01x"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(PIECES), max_size=60))
def test_random_opcodes_are_answered_without_a_crash(pieces):
    try:
        state = check_state(b"\x80\x04" + b"".join(pieces) + b".", KEY)
    except RendezvousStateError:
        return
    assert type(state) is _RendezvousState


LEGIT = pickle.dumps(torch_state(3))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, len(LEGIT) - 1), st.sampled_from(["flip", "insert", "delete"]),
                          st.integers(0, 255)), min_size=1, max_size=6))
def test_a_real_state_with_bytes_changed_is_refused_or_still_a_state(changes):
    data = bytearray(LEGIT)
    for where, how, byte in changes:
        where = min(where, len(data) - 1)
        if how == "flip":
            data[where] = byte
        elif how == "insert":
            data.insert(where, byte)
        elif len(data) > 1:
            del data[where]
    try:
        state = check_state(bytes(data), KEY)
    except RendezvousStateError:
        return
    assert type(state) is _RendezvousState and type(state.participants) is dict


# Against a real coordinator with a token: a plain client that holds it plants the pickle.
def test_torchs_state_holder_never_unpickles_a_state_planted_through_a_plain_client(start_coordinator, token_file,
                                                                                    tmp_path):
    coordinator = start_coordinator("--token-file", str(token_file), num_processes=2)
    marker = tmp_path / "ran"
    settings = RendezvousSettings("job", 1, 2, RendezvousTimeout(), timedelta(seconds=5), 1)
    with ifrt.Client(coordinator.address, session=False, transfer=False, token_file=str(token_file)) as attacker, \
            ifrt.Client(coordinator.address, session=False, transfer=False, token_file=str(token_file)) as agent:
        backend = IfrtRendezvousBackend(agent, KEY, timeout=10)
        checked = CheckedStateBackend(backend, KEY, max_nodes=2)  # what the handler's state holder reads through
        holder = _BackendRendezvousStateHolder(checked, settings, cache_duration=0)
        holder.sync()  # nothing stored yet: torch starts from an empty state
        attacker.kv_set(KEY, pickle.dumps(WritesMarker(marker)))
        with pytest.raises(RendezvousStateError, match=f"refused the rendezvous state at '{KEY}'.*system"):
            holder.sync()  # a read
        holder.mark_dirty()
        with pytest.raises(RendezvousStateError, match=f"refused the rendezvous state at '{KEY}'.*system"):
            holder.sync()  # a write that loses to the planted state and is handed it back
        expected = torch_state(2)
        legit = pickle.dumps(expected)
        attacker.kv_set(KEY, legit, allow_overwrite=True)
        assert backend.get_state() == (legit, legit)  # the backend: opaque bytes, as torch's contract says
        state, token = checked.get_state()  # torch gets the checked state; the stored bytes stay the token
        assert token == legit and vars(pickle.loads(state)) == vars(expected)
        holder.sync()
        assert vars(holder.state) == vars(expected)
    assert not marker.exists()
