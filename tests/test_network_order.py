"""Names in natural order and network paths compared level by level (ifrt.network)."""

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ifrt.errors import InvalidArgument
from ifrt.network import MAX_LEVELS, check_path, natural_key, path_key


@pytest.mark.parametrize("ordered", [
    [f"node{i}" for i in range(1, 13)],
    ["rack9", "rack10", "rack11", "rack100"],
    ["a", "a1", "a2", "a10", "b"],
    ["ip-10-0-1-7", "ip-10-0-1-66", "ip-10-0-2-3", "ip-10-0-10-1"],
    ["gke-pool-1-abc", "gke-pool-2-abc", "gke-pool-10-abc"],
    ["n01", "n1", "n2", "n010"],
    ["node10", "node10a", "node10b", "node11"],
])
def test_names_sort_with_runs_of_digits_as_numbers(ordered):
    shuffled = ordered[:]
    random.Random(7).shuffle(shuffled)
    assert sorted(shuffled, key=natural_key) == ordered


@given(st.lists(st.text(alphabet="ab01 9-", max_size=6), max_size=12))
def test_the_natural_order_is_total_and_agrees_with_equality(names):
    keys = [natural_key(n) for n in names]
    for a, ka in zip(names, keys, strict=True):
        for b, kb in zip(names, keys, strict=True):
            assert (ka == kb) == (a == b)


def test_paths_compare_level_by_level_and_a_prefix_sorts_first():
    paths = [("spine2", "rack10"), (), ("spine2",), ("spine10", "rack1"), ("spine2", "rack9"), ("spine1", "rack3")]
    assert sorted(paths, key=path_key) == [(), ("spine1", "rack3"), ("spine2",), ("spine2", "rack9"),
                                           ("spine2", "rack10"), ("spine10", "rack1")]


@pytest.mark.parametrize(("path", "message"), [
    (["l"] * (MAX_LEVELS + 1), "a network path of 9 levels"),
    (["spine1", "", "rack2"], "level 1 of the network path ['spine1', '', 'rack2'] is empty"),
    (["spine1", " "], "level 1 of the network path ['spine1', ' '] is empty"),
    (["s", "r" * 256], "level 1 of the network path is 256 bytes long: expected at most 255"),
])
def test_a_bad_path_is_refused_naming_its_source(path, message):
    with pytest.raises(InvalidArgument, match=r"^IFRT_NETWORK_NODES: ") as info:
        check_path(path, "IFRT_NETWORK_NODES")
    assert message in str(info.value)
