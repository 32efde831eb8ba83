import pytest
from hypothesis import given
from hypothesis import strategies as st

from ifrt import global_device_id, split_global_id
from ifrt.ids import MAX_LOCAL_DEVICES, MAX_PROCESSES, MAX_PROCESSES_INT64

process_ids = st.integers(0, MAX_PROCESSES - 1)
local_ids = st.integers(0, MAX_LOCAL_DEVICES - 1)


@given(process_ids, local_ids)
def test_split_inverts_global_id(process_id, local_id):
    assert split_global_id(global_device_id(process_id, local_id)) == (process_id, local_id)


@given(process_ids, local_ids)
def test_global_id_fits_in_int32_by_default(process_id, local_id):
    assert 0 <= global_device_id(process_id, local_id) < 2**31


@given(st.tuples(process_ids, local_ids), st.tuples(process_ids, local_ids))
def test_distinct_pairs_get_distinct_global_ids(a, b):
    assert (global_device_id(*a) == global_device_id(*b)) == (a == b)


@given(st.integers(0, MAX_PROCESSES_INT64 - 1), local_ids)
def test_int64_ids_round_trip_when_opted_in(process_id, local_id):
    gid = global_device_id(process_id, local_id, MAX_PROCESSES_INT64)
    assert gid < 2**63
    assert split_global_id(gid, MAX_PROCESSES_INT64) == (process_id, local_id)


def test_known_value():
    assert global_device_id(3, 5) == 3 * 131072 + 5


@pytest.mark.parametrize(("process_id", "local_id", "named"), [
    (0, MAX_LOCAL_DEVICES, "131072"), (0, -1, "-1"), (MAX_PROCESSES, 0, "16384"), (-1, 0, "-1"),
])
def test_out_of_range_names_value_and_limit(process_id, local_id, named):
    with pytest.raises(ValueError, match="out of range") as info:
        global_device_id(process_id, local_id)
    assert named in str(info.value)
    assert "expected" in str(info.value)


def test_limits_keep_global_ids_in_int32_unless_opted_out():
    assert (MAX_PROCESSES, MAX_LOCAL_DEVICES, MAX_PROCESSES_INT64) == (16384, 131072, 70368744177664)
    assert global_device_id(16383, 131071) == 2147483647  # the largest id: int32's maximum
    assert global_device_id(16384, 0, MAX_PROCESSES_INT64) == 2147483648


def test_split_rejects_ids_beyond_int32_limit():
    with pytest.raises(ValueError, match="2147483648"):
        split_global_id(2147483648)
