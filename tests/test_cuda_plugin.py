"""The cuda plugin's decisions, without a GPU: sharing GPUs between local ranks, CUDA_VISIBLE_DEVICES, NVLink peers."""

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ifrt.errors import InvalidArgument
from plugins.cuda import gpu_device, nvlink_gpu_peers, split_gpus, visible_gpus, visible_share

UUIDS = [
    "GPU-8a1c4f2e-6b0d-4c1e-9f3a-2d5b7e8c9a01",
    "GPU-8a1c9d33-0e4f-4a2b-8c6d-1f2e3a4b5c6d",
    "GPU-b7d2e0f1-3c4d-4e5f-8a9b-0c1d2e3f4a5b",
    "GPU-c3e0a1b2-4d5e-4f60-9a1b-2c3d4e5f6a7b",
]
"""Four GPUs as NVML lists them; the first two share the prefix GPU-8a1c."""


# sharing a host's GPUs between its processes
@pytest.mark.parametrize(("gpus", "rank", "world", "share"), [
    (4, 0, 1, [0, 1, 2, 3]),
    (8, 0, 4, [0, 1]),
    (8, 3, 4, [6, 7]),
    (4, 3, 4, [3]),
    (8, 0, 3, [0, 1, 2]),  # 8 over 3: the first two ranks get one more
    (8, 1, 3, [3, 4, 5]),
    (8, 2, 3, [6, 7]),
    (5, 4, 5, [4]),
    (7, 1, 2, [4, 5, 6]),
])
def test_each_local_rank_gets_a_contiguous_share(gpus, rank, world, share):
    assert split_gpus(gpus, rank, world) == share


@given(st.integers(1, 64).flatmap(lambda gpus: st.tuples(st.just(gpus), st.integers(1, gpus))))
def test_shares_use_every_gpu_once_and_differ_by_at_most_one(gpus_and_world):
    gpus, world = gpus_and_world
    shares = [split_gpus(gpus, rank, world) for rank in range(world)]
    assert [i for share in shares for i in share] == list(range(gpus))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


@pytest.mark.parametrize("rank", range(8))
def test_more_processes_than_gpus_is_an_error_naming_both_counts(rank):
    with pytest.raises(InvalidArgument) as info:
        split_gpus(4, rank, 8)
    assert str(info.value) == ("8 processes on this host but only 4 GPUs: expected at most one process per GPU "
                               "(or set CUDA_VISIBLE_DEVICES for each process)")


@pytest.mark.parametrize(("gpus", "rank", "world", "message"), [
    (0, 0, 2, "2 processes on this host but only 0 GPUs"),
    (4, 4, 4, "local rank 4 is out of range: expected 0 <= local_rank < 4"),
    (4, -1, 4, "local rank -1 is out of range: expected 0 <= local_rank < 4"),
    (4, 0, 0, "local world size 0 is out of range: expected at least 1 process"),
])
def test_impossible_shares_say_what_is_wrong(gpus, rank, world, message):
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        split_gpus(gpus, rank, world)


@pytest.mark.parametrize(("rank", "value"), [
    (0, "GPU-8a1c4f2e-6b0d-4c1e-9f3a-2d5b7e8c9a01,GPU-8a1c9d33-0e4f-4a2b-8c6d-1f2e3a4b5c6d"),
    (1, "GPU-b7d2e0f1-3c4d-4e5f-8a9b-0c1d2e3f4a5b,GPU-c3e0a1b2-4d5e-4f60-9a1b-2c3d4e5f6a7b"),
])
def test_a_share_is_set_by_uuid_and_read_back_as_the_same_gpus(rank, value):
    assert visible_share(UUIDS, rank, 2) == value
    assert visible_gpus(value, UUIDS) == split_gpus(4, rank, 2)


# reading CUDA_VISIBLE_DEVICES
@pytest.mark.parametrize(("raw", "indices"), [
    (None, [0, 1, 2, 3]),
    ("0,2", [0, 2]),
    ("2,1", [2, 1]),  # CUDA numbers them in the order listed
    ("3", [3]),
    (" 1 , 0 ,", [1, 0]),
    ("GPU-b7d2e0f1-3c4d-4e5f-8a9b-0c1d2e3f4a5b", [2]),
    ("GPU-b7d2", [2]),  # a prefix that names one GPU, as nvidia-smi users write it
    ("GPU-8a1c9", [1]),
    ("GPU-B7D2E0F1", [2]),
    ("GPU-c3e0,0", [3, 0]),
    ("0,2,-1,1", [0, 2]),  # CUDA's documented end of the list
])
def test_visible_devices_select_gpus_as_cuda_numbers_them(raw, indices):
    assert visible_gpus(raw, UUIDS) == indices


@pytest.mark.parametrize(("raw", "message"), [
    ("0,7", "CUDA_VISIBLE_DEVICES='0,7': '7' names no GPU here: expected an index below 4 or a UUID (or the "
            "start of one) of GPU-8a1c4f2e-6b0d-4c1e-9f3a-2d5b7e8c9a01, "),
    ("GPU-ffff", "'GPU-ffff' names no GPU here"),
    ("MIG-GPU-8a1c4f2e-6b0d-4c1e-9f3a-2d5b7e8c9a01/1/0", "names no GPU here"),
    ("gpu0", "'gpu0' names no GPU here"),
    ("GPU-8a1c", "'GPU-8a1c' starts the UUIDs of GPUs [0, 1]: expected enough characters to name one GPU"),
    ("0,0", "'0' names GPU 0 again: expected each GPU at most once"),
    ("1,GPU-8a1c9", "'GPU-8a1c9' names GPU 1 again"),
    ("", "no GPU is visible to this process (CUDA_VISIBLE_DEVICES='' hides every GPU)"),
    ("-1", "no GPU is visible to this process (CUDA_VISIBLE_DEVICES='-1' hides every GPU)"),
])
def test_visible_devices_that_cuda_would_cut_short_are_errors(raw, message):
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        visible_gpus(raw, UUIDS)


def test_a_host_without_gpus_is_an_error():
    with pytest.raises(InvalidArgument, match=re.escape("no GPU is visible to this process (NVML sees no GPU)")):
        visible_gpus(None, [])


# NVLink peers
BUS_IDS = ["00000000:07:00.0", "00000000:0F:00.0", "00000000:47:00.0", "00000000:4E:00.0"]


@pytest.mark.parametrize(("own", "remote", "peers"), [
    ("00000000:07:00.0", ["00000000:0F:00.0", "00000000:0F:00.0", "00000000:47:00.0"],
     ["00000000:0F:00.0", "00000000:47:00.0"]),  # two links to one GPU: one peer
    ("00000000:07:00.0", ["00000000:C1:00.0", "00000000:C2:00.0"], []),  # NVSwitches: not GPUs
    ("00000000:07:00.0", ["00000000:07:00.0"], []),  # the GPU itself
    ("00000000:07:00.0", ["00000000:4e:00.0", "00000000:C1:00.0"], ["00000000:4E:00.0"]),  # case differs
    ("00000000:47:00.0", ["00000000:07:00.0", "00000000:4E:00.0"], ["00000000:07:00.0", "00000000:4E:00.0"]),
    ("00000000:07:00.0", [], []),
])
def test_nvlink_peers_are_the_other_gpus_at_the_far_end(own, remote, peers):
    assert nvlink_gpu_peers(own, remote, BUS_IDS) == peers


# what is published and what stays on the host
def test_a_gpus_host_facts_stay_on_the_host_and_what_others_need_is_published():
    device = gpu_device(1, "NVIDIA H100 80GB HBM3", 85_520_809_984, "node-17", uuid=UUIDS[2], nvml_index=2,
                        pci_bus_id=BUS_IDS[2], nvlink_peers=[BUS_IDS[0], BUS_IDS[3]])
    assert (device.local_id, device.platform, device.kind, device.slice_key) == (1, "cuda", "NVIDIA H100 80GB HBM3",
                                                                                 "node-17")
    assert dict(device.attributes) == {"memory_bytes": "85520809984"}
    assert dict(device.host_attributes) == {"uuid": UUIDS[2], "pci_bus_id": "00000000:47:00.0", "nvml_index": "2",
                                            "nvlink_peers": "00000000:07:00.0,00000000:4E:00.0"}


def test_a_gpu_without_nvlink_peers_has_no_peer_list():
    device = gpu_device(0, "NVIDIA L4", 24 << 30, "node-3", uuid=UUIDS[0], nvml_index=0, pci_bus_id=BUS_IDS[0],
                        nvlink_peers=[])
    assert "nvlink_peers" not in device.host_attributes
