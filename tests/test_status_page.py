"""The status page in a real headless Chromium, and `ifrt status --svg`, against a real coordinator and real processes
(one killed by pid): the failed process is drawn failed and named, in the browser's pixels and its DOM."""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import urllib.request
import xml.etree.ElementTree as ET
import zlib
from html import unescape as html_unescape
from pathlib import Path

import grpc
import pytest

from coordinator.core.status_page import events, fragment, page
from ifrt import status_svg
from ifrt._generated.coordinator_pb2_grpc import CoordinatorStub
from ifrt.records import Device
from tests.helpers import FAILED_REASON, HOST, ifrt_status, metrics_port, register_request, wait_status
from tests.replicas import leader_and_standby
from tests.requirements import require
from tests.workers import Worker

FAILED_RGB = tuple(int(status_svg.COLORS["failed"][i:i + 2], 16) for i in (1, 3, 5))
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars")


def chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """Runs Debian's chromium headless with a new empty profile (no network but the loopback page it is given)."""
    binary = shutil.which("chromium")
    if binary is None:
        require("chromium", "the status page is tested in a real headless browser (apt-get install -y chromium)")
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"
    profile.mkdir()
    return subprocess.run([binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)


def png_pixels(path: Path) -> tuple[int, int, list[bytearray]]:
    """Width, height and the RGB(A) rows of an 8-bit PNG (what Chromium writes), decoded with the standard library."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, chunks = 8, {}
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunks.setdefault(kind, []).append(data[pos + 8:pos + 8 + length])
        pos += 12 + length
    width, height, depth, color = struct.unpack(">IIBB", chunks[b"IHDR"][0][:10])
    assert depth == 8 and color in (2, 6), (depth, color)
    bpp = 3 if color == 2 else 4
    raw = zlib.decompress(b"".join(chunks[b"IDAT"]))
    stride, rows, prior = width * bpp, [], bytearray(width * bpp)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            left = line[i - bpp] if i >= bpp else 0
            up, corner = prior[i], prior[i - bpp] if i >= bpp else 0
            if kind == 1:
                line[i] = (line[i] + left) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + up) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 0xFF
            elif kind == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                line[i] = (line[i] + (left if pa <= pb and pa <= pc else up if pb <= pc else corner)) & 0xFF
        rows.append(line)
        prior = line
    return width, height, [bytearray(b"".join(bytes(r[x:x + 3]) for x in range(0, stride, bpp))) for r in rows]


def count_color(rows: list[bytearray], rgb: tuple[int, ...]) -> int:
    needle = bytes(rgb)
    return sum(sum(1 for x in range(0, len(r), 3) if r[x:x + 3] == needle) for r in rows)


def test_the_page_in_chromium_draws_the_killed_process_failed_and_names_it(start_coordinator, children, tmp_path):
    coordinator = start_coordinator("--heartbeat-timeout", "1", "--metrics-port", "0", "--metrics-bind", "127.0.0.1",
                                    num_processes=4)
    children += [Worker(coordinator.address, pid, 4) for pid in range(4)]
    for w in children:
        w.expect("topology")
    children[2].kill9()
    view = wait_status(coordinator.address, lambda v: v["state"] == "degraded")
    assert [p["process_id"] for p in view["failed"]] == [2]
    url = f"http://127.0.0.1:{metrics_port(coordinator)}/"

    # The DOM after the page's own script has fetched a fresh view (it says when it updated).
    dom = chromium(tmp_path, "--virtual-time-budget=5000", "--dump-dom", url)
    assert dom.returncode == 0, dom.stderr
    assert re.search(r'<p id="note"[^>]*>updated ', dom.stdout), dom.stdout[-2000:]
    failed = re.findall(r'<g class="process (\w+)" data-process="(\d+)"', dom.stdout)
    assert sorted(failed) == [("alive", "0"), ("alive", "1"), ("alive", "3"), ("failed", "2")]
    # its OS pid, and its reason alone: a "heard from" age beside the reason's own would disagree with it
    hover = re.search(rf"<title>process 2 \(pid (\d+)\) on {re.escape(HOST)} \(127\.0\.0\.1\): failed, (.*?)</title>",
                      dom.stdout)
    assert hover and FAILED_REASON.fullmatch(hover.group(2)), dom.stdout[-3000:]
    assert int(hover.group(1)) == children[2].process.pid
    assert f"process 2 on {HOST} failed: " in dom.stdout  # the events, in the page's text
    for gid in (2 << 17, (2 << 17) + 1):  # process 2's devices, by global id
        assert f'class="id">{gid}</text>' in dom.stdout

    shot = tmp_path / "status-page.png"
    taken = chromium(tmp_path, "--window-size=1200,700", f"--screenshot={shot}", url)
    assert taken.returncode == 0 and shot.exists(), taken.stderr
    width, height, rows = png_pixels(shot)
    assert (width, height) == (1200, 700)
    assert count_color(rows, FAILED_RGB) > 500  # process 2's device cells and frame, not a stray pixel
    assert count_color(rows, tuple(int(status_svg.COLORS["alive"][i:i + 2], 16) for i in (1, 3, 5))) > 1500


def test_the_json_view_and_cli_svg_show_the_same_failed_process(start_coordinator, children, tmp_path):
    coordinator = start_coordinator("--heartbeat-timeout", "1", "--metrics-port", "0", "--metrics-bind", "127.0.0.1",
                                    "--attempt", "3", num_processes=2)
    children += [Worker(coordinator.address, pid, 2, env={"IFRT_ATTEMPT": "3"}) for pid in range(2)]
    for w in children:
        w.expect("topology")
    children[1].kill9()
    wait_status(coordinator.address, lambda v: v["state"] == "degraded")
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port(coordinator)}/status.json", timeout=10) as answer:
        view = json.loads(answer.read())
    assert (view["state"], view["attempt"], view["replicas"]) == (
        "degraded", 3, [{"address": coordinator.address, "role": "leader"}])
    assert [(p["process_id"], p["slice"], p["device_ids"], p["mesh_positions"]) for p in view["processes"]] == [
        (0, 0, [0, 1], [0, 1]), (1, 0, [1 << 17, (1 << 17) + 1], [2, 3])]

    picture = tmp_path / "cluster.svg"
    result = ifrt_status("--coordinator", coordinator.address, "--svg", str(picture))
    assert result.returncode == 0, result.stderr
    root = ET.parse(picture).getroot()  # well-formed, standalone SVG
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    marks = {g.get("data-process"): g.get("class") for g in root.iter("{http://www.w3.org/2000/svg}g")
             if g.get("data-process")}
    assert marks == {"0": "process alive", "1": "process failed"}
    assert "cluster default: degraded" in result.stdout


def _view(processes: int, per_host: int = 1, failed: tuple[int, ...] = (), missing: tuple[int, ...] = ()) -> dict:
    procs = [{"process_id": i, "host": f"host-{i // per_host:05d}", "host_address": f"10.0.{i // 256}.{i % 256}",
              "local_rank": i % per_host, "address": "", "devices": 8, "state": "failed" if i in failed else "alive",
              "reason": "lost its connection" if i in failed else "", "incarnation": 0, "heartbeat_age_s": 0.2,
              "attached": i not in failed, "slice": i // 64, "device_ids": [i << 17 | d for d in range(8)]}
             for i in range(processes) if i not in missing]
    return {"cluster_id": "big", "state": "degraded" if failed else "published", "generation": 1,
            "fingerprint": "ab" * 32, "registered": len(procs), "expected": processes, "missing": list(missing),
            "missing_count": len(missing), "failed": [], "processes": procs, "leader": "c:1", "replica": "c:1",
            "store": "memory", "reason": None, "waited_s": 0.0, "time_to_publish_s": 1.0, "sessions_open": 0,
            "heartbeat_timeout_s": 10.0, "replicas": [{"address": "c:1", "role": "leader"}], "attempt": 0}


def test_a_large_cluster_is_drawn_as_tiles_that_still_show_the_failed_and_missing():
    view = _view(16384, failed=(9000,), missing=(12345,))
    picture = status_svg.svg(view)
    assert "<rect" in picture and picture.count("<rect") < 1100  # ~1,000 tiles, not 16,384 hosts of 8 devices
    tiles = re.findall(r'fill="(#[0-9a-f]{6})"><title>([^<]*)</title>', picture)
    assert len(tiles) <= status_svg.MAX_TILES
    failed = [t for c, t in tiles if c == status_svg.COLORS["failed"]]
    assert len(failed) == 1 and "process 9000 on host-09000 (10.0.35.40): failed, lost its connection" in failed[0]
    missing = [t for c, t in tiles if c == status_svg.COLORS["missing"]]
    assert len(missing) == 1 and "process 12345 on (not registered): missing" in missing[0]
    assert "process 9000 on host-09000 failed: lost its connection" in page(view)


def test_a_standby_page_names_the_leader_and_draws_nothing_it_does_not_know():
    standby = {"cluster_id": "c", "state": "standby", "leader": "10.0.0.1:8476", "reason": "another replica leads",
               "replicas": [{"address": "10.0.0.2:8476", "role": "standby"}], "store": "etcd", "attempt": 0,
               "leader_error": "the leader's view could not be fetched: refused"}
    text = fragment(standby)
    assert "10.0.0.1:8476" in text and "stands by" in text and "<svg" not in text
    with_leader = fragment({**standby, "leader_view": _view(4, failed=(1,))})
    assert "<svg" in with_leader and 'class="process failed" data-process="1"' in with_leader


def test_events_list_failures_before_the_publication():
    assert events(_view(4, failed=(2,))) == ["process 2 on host-00002 failed: lost its connection",
                                             "generation 1 published 1.00s after the first registration"]


def test_a_picture_of_few_hosts_is_as_wide_as_what_it_draws():
    # Reproduced: one host was drawn 1,430 px wide (three host columns), so the page showed a needless scrollbar.
    widths = {hosts: int(re.search(r'width="(\d+)"', status_svg.svg(_view(hosts))).group(1)) for hosts in (1, 2, 3, 6)}
    assert widths[1] < widths[2] < widths[3] == widths[6]  # a host's column more each, up to a full row
    assert widths[1] < 700


@pytest.mark.parametrize("processes", [1, 64, 65, 4096])
def test_the_picture_is_well_formed_xml_at_every_size(processes):
    ET.fromstring(status_svg.svg(_view(processes, per_host=1)))


def test_a_standby_page_names_the_leader_and_shows_its_view(etcd, children, tmp_path):
    with leader_and_standby(etcd, "--metrics-port", "0", "--metrics-bind", "127.0.0.1", "--attempt", "2",
                            num_processes=1, cluster_id="job-p") as (first, second):
        children.append(Worker(first.address, 0, 1, env={"IFRT_ATTEMPT": "2"}))
        children[0].expect("topology")
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port(second)}/status.json", timeout=10) as r:
            view = json.loads(r.read())
        assert (view["state"], view["leader"], view["leader_view"]["state"]) == ("standby", first.address,
                                                                               "published")
        assert [p["process_id"] for p in view["leader_view"]["processes"]] == [0]
        assert view["attempt"] == view["leader_view"]["attempt"] == 2
        text = ifrt_status("--coordinator", f"{second.address},{first.address}").stdout
        assert "cluster job-p: published" in text and "\nattempt:    2\n" in text, text
        dom = chromium(tmp_path, "--virtual-time-budget=3000", "--dump-dom",
                       f"http://127.0.0.1:{metrics_port(second)}/status")
        assert f"This replica stands by; what the leader {first.address} reports:" in dom.stdout, dom.stdout
        assert '<g class="process alive" data-process="0"' in dom.stdout
        assert re.search(r'<p id="note"[^>]*>updated ', dom.stdout)


def test_restarting_slow_and_missing_processes_are_marked_with_why_on_hover():
    view = _view(4, missing=(3,))
    view["processes"][1].update(state="joining", incarnation=1)  # back after a failure, not yet in the topology
    view["processes"][2].update(heartbeat_age_s=6.0)  # over half the 10 s heartbeat timeout
    picture = status_svg.svg(view)
    marks = dict((pid, m) for m, pid in re.findall(r'<g class="process (\w+)" data-process="(\d+)"', picture))
    assert marks == {"0": "alive", "1": "restarting", "2": "slow", "3": "missing"}
    assert "process 2 on host-00002 (10.0.0.2): slow; heard from 6.0s ago" in picture
    assert "process 3 on (not registered): missing, has not registered" in picture
    assert "process 1 on host-00001 restarted (incarnation 1)" in events(view)


MEASURE = """<script>
// Where the browser drew each letter of the page's own words on the lines about processes, in the text's order.
const lines = [];
for (const li of document.querySelectorAll('#view li')) {
  const found = [];
  const walker = document.createTreeWalker(li, NodeFilter.SHOW_TEXT);
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    for (const word of ['process', 'failed', 'lost', 'connection', 'within', 'heard']) {
      for (let at = node.data.indexOf(word); at >= 0; at = node.data.indexOf(word, at + 1)) {
        const x = [];
        let top = 0;
        for (let i = at; i < at + word.length; i++) {
          const range = document.createRange();
          range.setStart(node, i);
          range.setEnd(node, i + 1);
          x.push(range.getBoundingClientRect().left);
          top = Math.round(range.getBoundingClientRect().top);
        }
        found.push({word: word, at: at, x: x, top: top});
      }
    }
  }
  found.sort((a, b) => a.at - b.at);
  lines.push(found);
}
const out = document.createElement('pre');
out.id = 'measured';
out.textContent = JSON.stringify(lines);
document.body.appendChild(out);
</script>"""


def test_a_hostname_with_bidi_overrides_cannot_reverse_the_pages_own_text(start_coordinator, tmp_path):
    """A process registers from the wire with a hostname holding RIGHT-TO-LEFT OVERRIDE, then fails: in Chromium,
    the page's own words on the lines about it are drawn left to right, letters and words in order, and the
    override shows as an escape."""
    coordinator = start_coordinator("--heartbeat-timeout", "1", "--metrics-port", "0", "--metrics-bind",
                                    "127.0.0.1", num_processes=1)
    host = "evil\u202eXYZ"
    with grpc.insecure_channel(coordinator.address) as channel:
        CoordinatorStub(channel).Register(register_request(0, hostname=host, num_processes=1), timeout=30)
    wait_status(coordinator.address, lambda v: v["state"] == "degraded")
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port(coordinator)}/", timeout=10) as answer:
        html = answer.read().decode()
    assert "\u202e" not in html and "evil\\u202eXYZ" in html
    saved = tmp_path / "page.html"  # the coordinator's page as served, with a script that reads the layout
    saved.write_text(html.replace("</body>", MEASURE + "</body>"))
    dom = chromium(tmp_path, "--virtual-time-budget=1000", "--dump-dom", saved.as_uri())
    assert dom.returncode == 0, dom.stderr
    measured = re.search(r'<pre id="measured">(.*?)</pre>', dom.stdout, re.S)
    assert measured, dom.stdout[-2000:]
    lines = json.loads(html_unescape(measured.group(1)))
    assert len(lines) == 3 and all(lines[:2]), lines  # the process in trouble, its event, the publication
    for words in lines:
        assert {w["word"] for w in words} >= {"process", "failed", "lost", "connection"} or not words, words
        for w in words:
            assert w["x"] == sorted(w["x"]) and len(set(w["x"])) == len(w["x"]), f"letters out of order: {w}"
        starts = [(w["top"], w["x"][0]) for w in words]  # a long line wraps: top to bottom, then left to right
        assert starts == sorted(starts), f"words out of order: {words}"


# Hosts grouped into their racks where processes have a network position.
def network_view_of(processes: list[dict]) -> dict:
    return {"cluster_id": "racks", "state": "degraded", "generation": 1, "fingerprint": "ab" * 32,
            "registered": len(processes), "expected": len(processes), "missing": [], "missing_count": 0,
            "failed": [], "processes": processes, "leader": "c:1", "replica": "c:1", "store": "memory",
            "reason": None, "waited_s": 0.0, "time_to_publish_s": 1.0, "sessions_open": 0,
            "heartbeat_timeout_s": 10.0, "replicas": [{"address": "c:1", "role": "leader"}], "attempt": 0}


def placed_process(pid: int, host: str, path: tuple[str, ...], failed: bool = False, slice_index: int = 0) -> dict:
    return {"process_id": pid, "host": host, "host_address": "", "local_rank": 0, "address": "", "devices": 2,
            "state": "failed" if failed else "alive", "reason": "lost its connection" if failed else "",
            "incarnation": 0, "heartbeat_age_s": 0.1, "attached": not failed, "slice": slice_index,
            "device_ids": [pid << 17, pid << 17 | 1], "network": list(path)}


def test_hosts_are_drawn_in_bands_per_rack_in_network_order_whatever_the_ids():
    # ids in no network order; rack2 before rack10 and node9 before node10, as the mesh orders them
    placed = [(0, "node10", ("spine", "rack2")), (1, "node1", ("spine", "rack10")), (2, "node9", ("spine", "rack2")),
              (3, "node2", ("spine", "rack10"))]
    picture = status_svg.svg(network_view_of([placed_process(*p) for p in placed]))
    drawn = re.findall(r'data-network="([^"]*)"|data-process="(\d+)"', picture)
    assert [a or int(b) for a, b in drawn] == ["spine / rack2", 2, 0, "spine / rack10", 1, 3]
    assert "leaf switch spine / rack2, slice 0" in picture


def test_topology_extras_carry_each_processes_network_position():
    devices = [Device(p << 17 | i, p, i, "cpu", "cpu") for p in (0, 1) for i in range(2)]
    extras = status_svg.topology_extras(devices, {0: "b", 1: "a"}, {0: ("s", "r1"), 1: ("s", "r2")})
    assert extras[0]["network"] == ["s", "r1"] and extras[1]["network"] == ["s", "r2"]
    assert extras[0]["mesh_positions"] == [0, 1]  # rack r1 first, though its host sorts after "a"
    assert "network" not in status_svg.topology_extras(devices, {0: "b", 1: "a"})[0]


def test_a_large_cluster_shows_a_row_per_rack_and_the_failed_host_in_its_racks_row_in_chromium(tmp_path):
    # 1,024 hosts in 64 racks of 16; host 600 (rack38) failed; ids shuffled against the racks
    processes = [placed_process((h * 389) % 1024, f"node{h + 1}",
                                ("spine", f"block{h // 128 + 1}", f"rack{h // 16 + 1}"), failed=h == 600)
                 for h in range(1024)]
    picture = status_svg.svg(network_view_of(processes))
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
