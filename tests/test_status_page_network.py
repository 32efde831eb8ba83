"""The status page groups hosts into their racks where processes have a network position: a band per rack in the
detailed picture, a named row per rack of tiles in a large one (checked in headless Chromium's pixels)."""

from __future__ import annotations

import re

from ifrt import status_svg
from ifrt.records import Device
from tests.test_status_page import FAILED_RGB, chromium, png_pixels


def view_of(processes: list[dict]) -> dict:
    return {"cluster_id": "racks", "state": "degraded", "generation": 1, "fingerprint": "ab" * 32,
            "registered": len(processes), "expected": len(processes), "missing": [], "missing_count": 0,
            "failed": [], "processes": processes, "leader": "c:1", "replica": "c:1", "store": "memory",
            "reason": None, "waited_s": 0.0, "time_to_publish_s": 1.0, "sessions_open": 0,
            "heartbeat_timeout_s": 10.0, "replicas": [{"address": "c:1", "role": "leader"}], "attempt": 0}


def process(pid: int, host: str, path: tuple[str, ...], failed: bool = False, slice_index: int = 0) -> dict:
    return {"process_id": pid, "host": host, "host_address": "", "local_rank": 0, "address": "", "devices": 2,
            "state": "failed" if failed else "alive", "reason": "lost its connection" if failed else "",
            "incarnation": 0, "heartbeat_age_s": 0.1, "attached": not failed, "slice": slice_index,
            "device_ids": [pid << 17, pid << 17 | 1], "network": list(path)}


def test_hosts_are_drawn_in_bands_per_rack_in_network_order_whatever_the_ids():
    # ids in no network order; rack2 before rack10 and node9 before node10, as the mesh orders them
    placed = [(0, "node10", ("spine", "rack2")), (1, "node1", ("spine", "rack10")), (2, "node9", ("spine", "rack2")),
              (3, "node2", ("spine", "rack10"))]
    picture = status_svg.svg(view_of([process(*p) for p in placed]))
    drawn = re.findall(r'data-network="([^"]*)"|data-process="(\d+)"', picture)
    assert [a or int(b) for a, b in drawn] == ["spine / rack2", 2, 0, "spine / rack10", 1, 3]
    assert "rack spine / rack2, slice 0" in picture


def test_topology_extras_carry_each_processes_network_position():
    devices = [Device(p << 17 | i, p, i, "cpu", "cpu") for p in (0, 1) for i in range(2)]
    extras = status_svg.topology_extras(devices, {0: "b", 1: "a"}, {0: ("s", "r1"), 1: ("s", "r2")})
    assert extras[0]["network"] == ["s", "r1"] and extras[1]["network"] == ["s", "r2"]
    assert extras[0]["mesh_positions"] == [0, 1]  # rack r1 first, though its host sorts after "a"
    assert "network" not in status_svg.topology_extras(devices, {0: "b", 1: "a"})[0]


def test_a_large_cluster_shows_a_row_per_rack_and_the_failed_host_in_its_racks_row_in_chromium(tmp_path):
    # 1,024 hosts in 64 racks of 16; host 600 (rack38) failed; ids shuffled against the racks
    processes = [process((h * 389) % 1024, f"node{h + 1}", ("spine", f"block{h // 128 + 1}", f"rack{h // 16 + 1}"),
                         failed=h == 600) for h in range(1024)]
    picture = status_svg.svg(view_of(processes))
    assert "1024 hosts, 1 a tile in 64 racks" in picture
    labels = re.findall(r'data-network="([^"]*)"', picture)
    assert labels[:3] == ["spine / block1 / rack1", "spine / block1 / rack2", "spine / block1 / rack3"]
    assert len(labels) == 64
    page = tmp_path / "racks.svg"
    page.write_text(picture)
    shot = tmp_path / "racks.png"
    taken = chromium(tmp_path, "--window-size=1400,1000", f"--screenshot={shot}", page.as_uri())
    assert taken.returncode == 0 and shot.exists(), taken.stderr
    _, _, rows = png_pixels(shot)
    red = bytes(FAILED_RGB)
    red_rows = [y for y, r in enumerate(rows) if y > 30 and any(r[x:x + 3] == red for x in range(0, len(r), 3))]
    top = 34 + 20 + 37 * (status_svg._TILE + 2)  # rack38's row: the 38th, after the legend and the note
    assert red_rows and all(top <= y < top + status_svg._TILE for y in red_rows), red_rows  # below the legend
    # the failed tile is the 9th of its row (host 600 is the 9th of rack38), right of the racks' names
    x_failed = [x // 3 for x in range(0, len(rows[top + 5]), 3) if rows[top + 5][x:x + 3] == red]
    left = 10 + status_svg._RACK_LABEL_W + 8 * (status_svg._TILE + 2)
    assert x_failed and min(x_failed) >= left and max(x_failed) < left + status_svg._TILE, x_failed
