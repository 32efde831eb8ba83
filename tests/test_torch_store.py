"""ifrt.torch.Store: every c10d store method on a real coordinator, called from Python and from c10d's C++ side."""

from __future__ import annotations

import importlib.util
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta

import pytest

from tests.requirements import require

if importlib.util.find_spec("torch") is None:
    require("torch", "pip install 'ifrt-topology[torch]' (scripts/test.sh installs a CPU build)")

import torch.distributed as dist

import ifrt
import ifrt.torch
from coordinator.core.limits import DEFAULT_LIMITS
from coordinator.local import LocalCoordinator
from tests.helpers import COMPARE_SET_TABLE, rpc_calls
from tests.tls import make_certs

SHORT = 0.5


@pytest.fixture(scope="module")
def coordinator():
    """A one-process cluster's coordinator, shared by this module's tests; it counts its calls (/metrics)."""
    with LocalCoordinator("--metrics-port", "0", num_processes=1) as started:
        yield started


@pytest.fixture(scope="module")
def client(coordinator):
    """One process of that cluster, shared by this module's tests (each uses its own prefix)."""
    with ifrt.Client(coordinator.address, process_id=0, num_processes=1, transfer=False, timeout=30) as made:
        made.discover()
        yield made


@pytest.fixture
def store(client):
    return ifrt.torch.Store(client, f"test/{uuid.uuid4().hex[:8]}/", timeout=SHORT)


def test_values_are_bytes_both_ways_and_keys_str_or_bytes(store, client):
    store.set("bin", b"\x00\xff\x80")
    store.set(b"text", "é")
    assert store.get(b"bin") == b"\x00\xff\x80"
    assert store.get("text") == "é".encode()
    assert client.kv_try_get(store.prefix + "bin") == b"\x00\xff\x80"  # stored in ifrt's KV under the prefix
    store.set("bin", b"again")  # set overwrites, as c10d expects
    assert store.get("bin") == b"again"


def test_add_check_delete_and_num_keys(store):
    assert store.add("n", 3) == 3
    assert store.add(b"n", -1) == 2
    assert store.get("n") == b"2"
    assert store.check(["n"]) and not store.check(["n", "absent"])
    assert store.num_keys() == 1
    assert store.delete_key("n") is True
    assert store.delete_key("n") is False
    assert store.num_keys() == 0


def test_multi_get_multi_set_and_append(store):
    store.multi_set(["a", b"b"], [b"1", "2"])
    assert store.multi_get(["b", "a"]) == [b"2", b"1"]
    store.append("log", b"x")
    store.append("log", "yz")
    assert store.get("log") == b"xyz"
    with pytest.raises(ValueError, match="multi_set got 2 keys and 1 values"):
        store.multi_set(["a", "b"], [b"1"])


def calls_of(coordinator: LocalCoordinator, action: Callable[[], object]) -> dict[str, float]:
    """The calls the coordinator answered while ``action`` ran, by method."""
    before = rpc_calls(coordinator)
    action()
    return {m: n - before.get(m, 0.0) for m, n in rpc_calls(coordinator).items() if n != before.get(m, 0.0)}


def test_multi_set_multi_get_wait_and_check_of_many_keys_are_one_call_each(store, coordinator):
    keys = [f"k{i}" for i in range(8)]
    assert calls_of(coordinator, lambda: store.multi_set(keys, [str(i) for i in range(8)])) == {"KeyValueMultiSet": 1}
    got: list[bytes] = []
    assert calls_of(coordinator, lambda: got.extend(store.multi_get(keys[::-1]))) == {"KeyValueMultiGet": 1}
    assert got == [str(i).encode() for i in reversed(range(8))]  # in the order asked
    assert calls_of(coordinator, lambda: store.wait(keys)) == {"KeyValueMultiGet": 1}
    assert calls_of(coordinator, lambda: got.append(store.check([*keys, "absent"]))) == {"KeyValueMultiGet": 1}
    assert got[-1] is False and store.check(keys)


def test_multi_set_stores_every_value_or_none_naming_the_refused_key(store):
    too_big = b"x" * (DEFAULT_LIMITS.kv_value_bytes + 1)
    with pytest.raises(ifrt.InvalidArgument, match=r"value for key '.*/big' is \d+ bytes: expected at most"):
        store.multi_set(["fine", "big"], [b"1", too_big])
    assert not store.check(["fine"])  # the first value was not stored either
    store.multi_set(["twice", "other", "twice"], [b"1", b"o", b"2"])  # in order: a key given twice keeps its last
    assert store.multi_get(["twice", "other"]) == [b"2", b"o"]


def test_multi_get_waits_for_the_keys_still_unset(client):
    store = ifrt.torch.Store(client, f"test/{uuid.uuid4().hex[:8]}/", timeout=30)
    store.set("early", b"e")
    threading.Timer(0.3, store.multi_set, (["late", "later"], [b"l", b"m"])).start()
    assert store.multi_get(["early", "late", "later"]) == [b"e", b"l", b"m"]


def test_a_get_right_after_a_wait_for_its_key_is_answered_by_the_wait_and_any_call_between_asks_again(
        store, coordinator):
    store.set("k", b"1")

    def wait_then_get() -> None:
        store.wait(["k"])
        assert store.get("k") == b"1"

    assert calls_of(coordinator, wait_then_get) == {"KeyValueGet": 1}  # gloo's start: a wait, then a get, per rank
    store.wait(["k"])
    store.set("k", b"2")  # a call between: the get reads the coordinator again
    assert store.get("k") == b"2"
    store.wait(["k"])
    store.clone().set("k", b"3")  # also through a clone
    assert store.get("k") == b"3"
    store.wait(["k"])
    seen: list[bytes] = []

    def get_in_another_thread() -> None:  # the wait was this thread's: another thread's get asks the coordinator
        other = threading.Thread(target=lambda: seen.append(store.get("k")))
        other.start()
        other.join()

    assert calls_of(coordinator, get_in_another_thread) == {"KeyValueGet": 1} and seen == [b"3"]


@pytest.mark.parametrize(("before", "expected", "desired", "answer", "after"), COMPARE_SET_TABLE)
def test_compare_set_answers_as_tcpstore_does(store, before, expected, desired, answer, after):
    if before is not None:
        store.set("k", before)
    # TCPStore's answer for an unset key and a non-empty `expected` is `expected` itself
    assert store.compare_set("k", expected, desired) == (expected if answer is None else answer)
    assert store.check(["k"]) == (after is not None)
    if after is not None:
        assert store.get("k") == after


def test_get_and_wait_time_out_with_torchs_error_naming_the_keys(store):
    store.set("here", b"1")
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match=r"ifrt store: wait timeout: key 'absent' not set within 0\.5s"):
        store.get("absent")
    assert time.monotonic() - started < 30
    with pytest.raises(dist.DistStoreError, match=r"wait timeout: keys 'x', 'y' not set within 0\.2s"):
        store.wait(["here", "x", "y"], timedelta(seconds=0.2))
    store.wait(["here"])


def test_a_timeout_says_timeout_as_tcpstores_does_from_python_and_through_cpp(store):
    """PyTorch's code and tests match a store's timeout on the word (TCPStore: "wait timeout after 300ms, keys:
    /absent"): ours says it on get and wait, called from Python and from a C++ PrefixStore on top."""
    tcp = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=0.2))
    calls = {"get": lambda s: s.get("absent"), "wait": lambda s: s.wait(["x"], timedelta(seconds=0.2)),
             "through C++": lambda s: dist.PrefixStore("pg", s).get("absent")}
    store.set_timeout(timedelta(seconds=0.2))
    for call in calls.values():
        for which in (tcp, store):
            with pytest.raises(dist.DistStoreError, match="wait timeout"):
                call(which)


def test_a_blocked_get_returns_once_another_caller_sets_the_key(client):
    store = ifrt.torch.Store(client, f"test/{uuid.uuid4().hex[:8]}/", timeout=30)
    threading.Timer(0.3, store.set, ("late", b"v")).start()
    assert store.get("late") == b"v"


def test_the_watch_ends_a_wait_with_its_own_error(store):
    def peer_failed() -> None:
        raise ifrt.BarrierFailed("process 1 failed")

    store.watch = peer_failed
    store.set_timeout(timedelta(seconds=30))
    started = time.monotonic()
    with pytest.raises(ifrt.BarrierFailed, match="process 1 failed"):
        store.get("never")
    assert time.monotonic() - started < 10


def test_a_timeout_names_the_process_expected_to_set_the_key(client, store):
    exchange = ifrt.torch.StartupExchange(client, client.topology, time.monotonic() + 5)
    store.describe_missing = exchange.describe_keys
    with pytest.raises(dist.DistStoreError, match=r"key '0//cpu//0/0' not set .*: expected from process 0 \("):
        store.get("0//cpu//0/0")


def test_c10d_reaches_every_method_through_its_cpp_side(store):
    prefixed = dist.PrefixStore("pg", store)  # a C++ store calling the Python one
    prefixed.set("a", "1")
    assert prefixed.get("a") == b"1"
    assert prefixed.add("n", 5) == 5
    assert prefixed.compare_set("a", "1", "2") == b"2"
    assert prefixed.check(["a", "n"])
    assert prefixed.num_keys() == 2
    assert prefixed.delete_key("a")
    assert prefixed.multi_get(["n"]) == [b"5"]
    with pytest.raises(dist.DistStoreError, match=r"key 'pg/absent' not set"):
        prefixed.wait(["absent"], timedelta(seconds=0.2))


def test_a_process_group_starts_on_the_store_alone(store):
    store.set_timeout(timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        group = dist.new_group([0])
        assert dist.get_world_size(group) == 1
    finally:
        dist.destroy_process_group()
    assert store.num_keys() > 0  # c10d's keys went to ifrt, under the prefix


def test_the_stores_multi_key_calls_run_behind_the_token_and_tls(tmp_path):
    certs = tmp_path / "certs"
    certs.mkdir()
    make_certs(certs)
    token = tmp_path / "token"
    token.write_text("the store's token\n")
    env = {"IFRT_TOKEN_FILE": str(token), "IFRT_TLS_CA": str(certs / "ca.pem")}
    with LocalCoordinator("--token-file", str(token), "--tls-cert", str(certs / "server.pem"), "--tls-key",
                          str(certs / "server-key.pem"), num_processes=1) as secured, \
            ifrt.Client(secured.address, process_id=0, num_processes=1, transfer=False, timeout=30,
                        environ=env) as client:
        client.discover()
        store = ifrt.torch.Store(client, "secured/", timeout=SHORT)
        store.multi_set(["a", "b"], [b"1", "2"])  # KeyValueMultiSet
        assert store.multi_get(["b", "a"]) == [b"2", b"1"]  # KeyValueMultiGet
        assert store.check(["a", "b"]) and not store.check(["a", "absent"])
        store.wait(["a", "b"])
        prefixed = dist.PrefixStore("pg/", store)  # from c10d's C++ side
        prefixed.multi_set(["c"], [b"3"])
        assert prefixed.multi_get(["c"]) == [b"3"]
        with pytest.raises(dist.DistStoreError, match=r"key 'absent' not set"):
            store.wait(["a", "absent"], timedelta(seconds=0.2))


# A process group's start: the ranks' keys come pushed.
RANK_KEY = "0//cpu//0/{}".format
"""gloo's key for each rank's address in the default group: set once by its rank, waited for by every rank."""


def test_a_starts_reads_of_the_ranks_keys_come_pushed_with_no_call_of_their_own(client, coordinator):
    store = ifrt.torch.Store(client, f"test/{uuid.uuid4().hex[:8]}/", timeout=30)
    client.kv_set(store.prefix + RANK_KEY(1), b"one")  # a rank ahead of this one: set before anything is watched
    store.follow_start(0)

    def gloos_start() -> None:  # its own key, then a wait and a get of each rank's
        store.set(RANK_KEY(0), b"zero")  # names the ranks' keys: watched from here on
        for rank, value in ((0, b"zero"), (1, b"one")):
            store.wait([RANK_KEY(rank)])
            assert store.get(RANK_KEY(rank)) == value

    assert calls_of(coordinator, gloos_start) == {"KeyValueSet": 1, "KeyValueDir": 1}  # the Dir: keys set before
    threading.Timer(0.2, client.kv_set, (store.prefix + RANK_KEY(2), b"two")).start()  # a rank behind this one
    got: list[bytes] = []
    assert calls_of(coordinator, lambda: got.extend(store.multi_get([RANK_KEY(2), RANK_KEY(1)]))) == {
        "KeyValueSet": 1}  # only the late rank's own set: this wait is answered by its push
    assert got == [b"two", b"one"]
    store.end_start()


def test_a_key_deleted_after_its_push_is_unset_again_for_the_start_and_times_out_as_ever(client):
    store = ifrt.torch.Store(client, f"test/{uuid.uuid4().hex[:8]}/", timeout=30)
    store.follow_start(0)
    store.set(RANK_KEY(0), b"zero")
    store.wait([RANK_KEY(0)])
    client.kv_delete(store.prefix + RANK_KEY(0))
    client.kv_set(store.prefix + RANK_KEY(1), b"one")
    store.wait([RANK_KEY(1)])  # pushes come in order: the deletion's came before this one
    with pytest.raises(dist.DistStoreError, match=r"^ifrt store: wait timeout: key '0//cpu//0/0' not set within "
                                                  r"0\.3s \(prefix 'test/[0-9a-f]+/'\)$"):
        store.wait([RANK_KEY(0)], timedelta(seconds=0.3))
    threading.Timer(0.2, client.kv_set, (store.prefix + RANK_KEY(0), b"again")).start()
    assert store.get(RANK_KEY(0)) == b"again"  # set again: pushed again
    store.end_start()


def test_reads_ask_the_coordinator_after_the_start_and_in_a_start_whose_first_key_names_no_rank(client, coordinator):
    store = ifrt.torch.Store(client, f"test/{uuid.uuid4().hex[:8]}/", timeout=30)
    store.follow_start(0)
    store.set(RANK_KEY(0), b"zero")
    store.wait([RANK_KEY(0)])
    assert calls_of(coordinator, lambda: store.wait([RANK_KEY(0)])) == {}  # in the start: pushed
    store.end_start()
    assert calls_of(coordinator, lambda: store.wait([RANK_KEY(0)])) == {"KeyValueGet": 1}
    store.follow_start(3)  # its first key does not end in its rank: nothing is watched
    store.set("store_based_barrier_key", b"1")
    assert calls_of(coordinator, lambda: store.wait([RANK_KEY(0)])) == {"KeyValueGet": 1}
    store.end_start()


def test_a_start_whose_watch_the_coordinator_refuses_asks_it_for_each_key():
    with LocalCoordinator("--max-watches-per-session", "1", "--metrics-port", "0", num_processes=1) as refusing, \
            ifrt.Client(refusing.address, process_id=0, num_processes=1, transfer=False, timeout=30) as client:
        client.discover()
        assert client.kv_follow("elsewhere/", lambda key, value: None).wait(30)  # the session's one watch
        store = ifrt.torch.Store(client, "refused/", timeout=30)
        client.kv_set(store.prefix + RANK_KEY(1), b"one")
        store.follow_start(0)
        store.set(RANK_KEY(0), b"zero")  # its watch is never acknowledged (over the limit)
        got: list[bytes] = []
        assert calls_of(refusing, lambda: got.extend(store.multi_get([RANK_KEY(0), RANK_KEY(1)]))) == {
            "KeyValueMultiGet": 1}  # after half a second without an acknowledgement: as outside a start
        assert got == [b"zero", b"one"]
        store.end_start()
