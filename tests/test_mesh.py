"""Meshes over real multi-process topologies: order, submeshes, tile assignments, argument selection, and the
submesh patterns runtimes hit, each on a zero-indexed and a non-zero-indexed submesh."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import ifrt
from coordinator.local import LocalCoordinator
from ifrt.mesh import denormalize, normalize


def discover_cluster(num: int, env: dict[str, str]) -> list[ifrt.Topology]:
    """``num`` in-process clients against a real coordinator; their topologies by process id."""
    results: list = [None] * num
    with LocalCoordinator(num_processes=num) as coordinator:
        def run(i: int) -> None:
            with ifrt.Client(coordinator.address, process_id=i, num_processes=num, timeout=60, session=False,
                             transfer=False) as c:
                results[i] = c.discover()

        threads = [threading.Thread(target=run, args=(i,)) for i in range(num)]
        with pytest.MonkeyPatch.context() as mp:
            for k, v in env.items():
                mp.setenv(k, v)
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
    assert all(isinstance(r, ifrt.Topology) for r in results), results
    return results


@pytest.fixture(scope="module")
def four() -> ifrt.Topology:
    """4 processes with 1 device each: global ids 0, 131072, 262144, 393216 (non-contiguous)."""
    return discover_cluster(4, {"IFRT_CPU_DEVICE_COUNT": "1"})[0]


@pytest.fixture(scope="module")
def torus() -> ifrt.Topology:
    """2 processes of 4 simulated devices on a 2x2 grid each."""
    return discover_cluster(2, {"IFRT_PLUGIN": "sim", "IFRT_SIM_SPEC": "kind=tpu,devices=4,coords=2x2"})[0]


def test_default_order_keeps_a_process_on_the_innermost_axis(torus):
    mesh = torus.mesh((2, 4), ("data", "model"))
    # one process per row; ring (snake) order over each process's 2x2 grid: (0,0) (0,1) (1,1) (1,0), which the
    # sim plugin numbers local ids 0, 1, 3, 2
    assert mesh.devices.tolist() == [[0, 1, 3, 2], [131072, 131073, 131075, 131074]]
    assert [torus.device(int(d)).coordinates for d in mesh.devices[0]] == [(0, 0), (0, 1), (1, 1), (1, 0)]


def test_mesh_shape_must_hold_every_device(four):
    with pytest.raises(ValueError, match=r"mesh shape \[3\] holds 3 devices; 4 were given"):
        four.mesh((3,), ("x",))


def test_explicit_device_order_is_kept(four):
    ids = [393216, 0, 262144, 131072]
    assert four.mesh((2, 2), ("a", "b"), devices=ids).devices.reshape(-1).tolist() == ids


def test_block_and_listed_submeshes(four):
    mesh = four.mesh((4,), ("x",))
    low, high = mesh.submesh((0,), (2,)), mesh.submesh((2,), (2,))
    assert low.devices.tolist() == [0, 131072] and high.devices.tolist() == [262144, 393216]
    assert high.positions.tolist() == [2, 3]
    listed = mesh.submesh(devices=[393216, 131072])
    assert listed.devices.tolist() == [393216, 131072] and listed.positions.tolist() == [3, 1]
    nested = mesh.submesh((1,), (3,)).submesh((1,), (2,))
    assert nested.positions.tolist() == [2, 3]  # positions compose back to the root mesh
    with pytest.raises(ValueError, match="offset 3 \\+ size 2 does not fit in 4"):
        mesh.submesh((3,), (2,))
    with pytest.raises(ValueError, match="not in this mesh"):
        low.submesh(devices=[262144])


def test_tile_assignments_normalized_and_denormalized(four):
    high = four.mesh((4,), ("x",)).submesh(devices=[393216, 262144])
    assert high.device_assignment().tolist() == [393216, 262144]
    assert high.tile_assignment().tolist() == [1, 0]
    assert high.device_list().tolist() == [262144, 393216]
    assert denormalize(high.tile_assignment(), high.device_list()).tolist() == [393216, 262144]


global_ids = st.lists(st.tuples(st.integers(0, 2**14 - 1), st.integers(0, 2**17 - 1)), min_size=1, max_size=64,
                      unique=True).map(lambda pairs: [ifrt.global_device_id(p, i) for p, i in pairs])


def test_normalize_gives_positions_in_the_sorted_device_list():
    tile, device_list = normalize(np.array([393216, 0, 262144, 131072]))
    assert tile.tolist() == [3, 0, 2, 1]
    assert device_list.tolist() == [0, 131072, 262144, 393216]
    tile, device_list = normalize(np.array([[262145, 5], [131072, 0]]))  # the shape is kept
    assert tile.tolist() == [[3, 1], [2, 0]]
    assert device_list.tolist() == [0, 5, 131072, 262145]


def test_denormalize_gives_the_global_ids_back():
    assert denormalize(np.array([3, 0, 2, 1]), [0, 131072, 262144, 393216]).tolist() == [393216, 0, 262144, 131072]
    # a submesh as a compiler sees it: positions 2 and 0 of the parent's device list
    assert denormalize(np.array([2, 0]), [0, 131072, 262144, 393216]).tolist() == [262144, 0]
    assert denormalize(np.array([[1], [0]]), [7, 9]).tolist() == [[9], [7]]


@given(global_ids)
def test_normalize_round_trips(ids):
    assignment = np.array(ids, dtype=np.int64)
    tile, device_list = normalize(assignment)
    assert sorted(tile.tolist()) == list(range(len(ids)))
    assert device_list.tolist() == sorted(ids)
    assert denormalize(tile, device_list).tolist() == ids


@given(global_ids, st.data())
def test_submesh_ids_are_inferred_from_its_tile_assignment(ids, data):
    parent = np.array(ids, dtype=np.int64)
    tile, device_list = normalize(parent)
    picked = data.draw(st.lists(st.integers(0, len(ids) - 1), min_size=1, unique=True))  # positions in the parent
    assert denormalize(tile[picked], device_list).tolist() == [ids[i] for i in picked]


def test_bad_tile_assignments_are_refused():
    with pytest.raises(ValueError, match="repeats global ids \\[5\\]"):
        normalize(np.array([5, 5]))
    with pytest.raises(ValueError, match=r"positions 0\.\.2: expected 0\.\.1"):
        denormalize(np.array([0, 2]), [10, 20])


# The submesh patterns runtimes hit, emulated with one numpy buffer per device: (offset, positions in the root).
SUBMESHES = {"zero-indexed (devices 0,1 of 4)": ((0,), [0, 1]), "non-zero-indexed (devices 2,3 of 4)": ((2,), [2, 3])}


def shard(array: np.ndarray, mesh: ifrt.Mesh, root: ifrt.Mesh) -> list[np.ndarray | None]:
    """Per-device buffers over the root mesh's devices, holding ``array`` split along axis 0 over ``mesh``."""
    handles: list[np.ndarray | None] = [None] * root.size
    for position, piece in zip(mesh.positions.reshape(-1), np.split(array, mesh.size), strict=True):
        handles[int(position)] = piece.copy()
    return handles


def read_back(mesh: ifrt.Mesh, handles: list) -> np.ndarray:
    return np.concatenate(mesh.select_arguments(handles))


@pytest.mark.parametrize(("offset", "positions"), SUBMESHES.values(), ids=SUBMESHES.keys())
def test_shard_both_operands_compute_and_read_back(four, offset, positions):
    root = four.mesh((4,), ("x",))
    sub = root.submesh(offset, (2,))
    assert sub.positions.tolist() == positions
    assert sub.devices.tolist() == [[0, 131072, 262144, 393216][p] for p in positions]
    a, b = np.arange(8.0), np.arange(8.0) * 10
    ha, hb = shard(a, sub, root), shard(b, sub, root)
    assert [h is not None for h in ha] == [p in positions for p in range(4)]
    assert [id(x) for x in sub.select_arguments(ha)] == [id(ha[p]) for p in positions]  # the parent's buffers
    out = [x + y for x, y in zip(sub.select_arguments(ha), sub.select_arguments(hb), strict=True)]
    assert np.concatenate(out).tolist() == [0, 11, 22, 33, 44, 55, 66, 77]


@pytest.mark.parametrize(("offset", "positions"), SUBMESHES.values(), ids=SUBMESHES.keys())
def test_shard_one_operand_with_a_replicated_other(four, offset, positions):
    root = four.mesh((4,), ("x",))
    sub = root.submesh(offset, (2,))
    a, scale = np.arange(8.0), np.float64(3)
    handles = shard(a, sub, root)
    assert [id(x) for x in sub.select_arguments(handles)] == [id(handles[p]) for p in positions]
    out = [x * scale for x in sub.select_arguments(handles)]
    assert np.concatenate(out).tolist() == [0, 3, 6, 9, 12, 15, 18, 21]


@pytest.mark.parametrize(("offset", "positions"), SUBMESHES.values(), ids=SUBMESHES.keys())
def test_read_back_before_and_after_an_in_place_update(four, offset, positions):
    root = four.mesh((4,), ("x",))
    sub = root.submesh(offset, (2,))
    handles = shard(np.arange(4.0), sub, root)
    assert [h.tolist() for h in handles if h is not None] == [[0, 1], [2, 3]]
    assert [handles[p].tolist() for p in positions] == [[0, 1], [2, 3]]
    before = read_back(sub, handles)
    for buffer in sub.select_arguments(handles):
        buffer += 100  # in place, on each device's buffer
    assert before.tolist() == [0, 1, 2, 3]
    assert read_back(sub, handles).tolist() == [100, 101, 102, 103]


def test_missing_buffer_is_named(four):
    root = four.mesh((4,), ("x",))
    sub = root.submesh((2,), (2,))
    handles = shard(np.arange(4.0), sub, root)
    handles[3] = None
    with pytest.raises(ValueError, match="no buffer for global device 393216 \\(position 3 of the parent mesh\\)"):
        sub.select_arguments(handles)
    with pytest.raises(ValueError, match="3 handles for a mesh of 4 devices"):
        sub.select_arguments(handles[:3])


def test_virtual_device_stands_for_the_mesh(torus):
    mesh = torus.mesh((2, 4), ("data", "model"))
    device = mesh.virtual_device
    assert device.kind == "spmd[2x4]" and device.platform == "sim"
    assert [d.id for d in device.members] == [0, 1, 3, 2, 131072, 131073, 131075, 131074]  # in mesh order
