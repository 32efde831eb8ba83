"""torch's ``RendezvousBackend`` contract, held by ifrt's backend against a real coordinator: opaque bytes in and out,
compare-and-set fenced by tokens. The checks are those of torch's own backend tests
(pytorch/pytorch test/distributed/elastic/rendezvous/rendezvous_backend_test.py, ``RendezvousBackendTestMixin``,
which torch does not install), one test each; then what torch's state holder reads through
(``CheckedStateBackend``): the check, where torch would unpickle, and the handler wired to it."""

from __future__ import annotations

import itertools
import pickle
from collections.abc import Iterator

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousParameters, RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

import ifrt
import ifrt.torchrun.state
from coordinator.local import LocalCoordinator
from ifrt.torchrun.backend import KEY_PREFIX, IfrtRendezvousBackend, create_rendezvous_handler
from ifrt.torchrun.state import CheckedStateBackend

_keys = itertools.count()


@pytest.fixture(scope="module")
def coordinator() -> Iterator[LocalCoordinator]:
    coordinator = LocalCoordinator(num_processes=2)
    try:
        yield coordinator
    finally:
        coordinator.close()


@pytest.fixture
def client(coordinator) -> Iterator[ifrt.Client]:
    with ifrt.Client(coordinator.address, session=False, transfer=False) as client:
        yield client


@pytest.fixture
def key() -> str:
    return f"{KEY_PREFIX}contract{next(_keys)}/state"


@pytest.fixture
def backend(client, key) -> IfrtRendezvousBackend:
    return IfrtRendezvousBackend(client, key, timeout=10)


def set_state(backend: IfrtRendezvousBackend, state: bytes, token: object = None) -> tuple:
    result = backend.set_state(state, token)
    assert result is not None
    return result


# RendezvousBackendTestMixin's tests, in its order (its _corrupt_state has no counterpart: the values are opaque).
def test_get_state_returns_backend_state(backend):
    backend.set_state(b"x")
    result = backend.get_state()
    assert result is not None
    state, token = result
    assert state == b"x" and token is not None


def test_get_state_returns_none_if_backend_state_does_not_exist(backend):
    assert backend.get_state() is None


def test_set_state_sets_backend_state_if_it_does_not_exist(backend):
    state, token, has_set = set_state(backend, b"x")
    assert state == b"x" and token is not None and has_set


def test_set_state_sets_backend_state_if_token_is_current(backend):
    _, token1, has_set1 = set_state(backend, b"x")
    state2, token2, has_set2 = set_state(backend, b"y", token1)
    assert state2 == b"y" and token1 != token2 and has_set1 and has_set2


def test_set_state_returns_current_backend_state_if_token_is_old(backend):
    _, token1, _ = set_state(backend, b"x")
    state2, token2, _ = set_state(backend, b"y", token1)
    state3, token3, has_set = set_state(backend, b"z", token1)
    assert (state3, token3, has_set) == (state2, token2, False)


def test_set_state_returns_current_backend_state_if_token_is_none(backend):
    state1, token1, _ = set_state(backend, b"x")
    state2, token2, has_set = set_state(backend, b"y")
    assert (state2, token2, has_set) == (state1, token1, False)


def test_set_state_returns_current_backend_state_if_token_is_invalid(backend):
    state1, token1, _ = set_state(backend, b"x")
    state2, token2, has_set = set_state(backend, b"y", token="invalid")
    assert (state2, token2, has_set) == (state1, token1, False)


def test_an_empty_value_reads_as_no_state_as_compare_and_set_treats_it(backend, client, key):
    client.kv_set(key, b"")
    assert backend.get_state() is None
    assert set_state(backend, b"x") == (b"x", b"x", True)


# What torch's state holder reads through.
def state_bytes(round_: int) -> bytes:
    state = _RendezvousState()
    state.round = round_
    return pickle.dumps(state)


def test_the_check_refuses_bytes_that_are_no_state_where_torch_would_unpickle_them(backend, client, key):
    """torch's test_get_state_raises_error_if_backend_state_is_corrupt, for what torch reads: b"x" is no state."""
    checked = CheckedStateBackend(backend, key)
    assert checked.name == "ifrt"
    assert checked.set_state(b"x") == (b"x", b"x", True)  # torch's own write is handed back as it is
    client.kv_set(key, b"y", allow_overwrite=True)  # another writer's
    with pytest.raises(RendezvousStateError, match=f"refused the rendezvous state at '{key}'.*no well-formed"):
        checked.get_state()
    with pytest.raises(RendezvousStateError, match=f"refused the rendezvous state at '{key}'"):
        checked.set_state(state_bytes(1), b"x")  # a lost write is handed the current state: checked too
    assert backend.get_state() == (b"y", b"y")  # the backend itself: opaque bytes


def test_an_unchanged_state_is_checked_once(backend, client, key, monkeypatch):
    checks = []
    check = ifrt.torchrun.state.check_state
    monkeypatch.setattr(ifrt.torchrun.state, "check_state", lambda *a: checks.append(a) or check(*a))
    checked = CheckedStateBackend(backend, key, max_nodes=4)
    s1, s2 = state_bytes(1), state_bytes(2)
    client.kv_set(key, s1)
    for _ in range(3):
        state, token = checked.get_state()
        assert token == s1 and pickle.loads(state).round == 1
    assert checks == [(s1, key, 4)]
    assert checked.set_state(s2, s1) == (s2, s2, True)
    assert checked.get_state() == (s2, s2)  # what torch wrote itself: handed back unchecked
    assert len(checks) == 1


def test_the_handler_reads_its_state_through_the_check(coordinator, monkeypatch):
    monkeypatch.delenv("IFRT_COORDINATOR", raising=False)
    params = RendezvousParameters("ifrt", coordinator.address, "wired", 1, 3, read_timeout="5")
    handler = create_rendezvous_handler(params)
    try:
        gate = handler._state_holder._backend  # torch's state holder: what it unpickles comes from here
        assert type(gate) is CheckedStateBackend and gate._max_nodes == 3
        assert gate._key == f"{KEY_PREFIX}wired/state"
    finally:
        handler.hosts.client.close()
