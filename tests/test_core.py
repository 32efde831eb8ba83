"""The coordinator's pure core (coordinator/core/) does no I/O: its modules import, even lazily, nothing that reaches
the network, threads, files, clocks or logs, no module of the shell around them, and of ifrt only its plain values.
Its decisions are then the same wherever they are replayed."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import typing
from pathlib import Path

from coordinator.core import journal
from coordinator.core.replays import REPLAYS
from coordinator.core.state import APPLY
from tests.helpers import published
from tests.replay_check import Recorder

ROOT = Path(__file__).parents[1]
CORE = ROOT / "coordinator" / "core"
IO = frozenset({"asyncio", "concurrent", "etcd3aio", "grpc", "grpc_health", "http", "io", "logging", "os", "pathlib",
                "prometheus_client", "select", "selectors", "shutil", "signal", "socket", "subprocess", "tempfile",
                "threading", "time", "urllib"})
"""Modules that reach outside the process or its clock (by their first name)."""
PLAIN_IFRT = frozenset({"ifrt", "ifrt._generated", "ifrt.errors", "ifrt.events", "ifrt.hostport", "ifrt.ids",
                        "ifrt.network", "ifrt.progress", "ifrt.protocol", "ifrt.records", "ifrt.safe_text"})
"""ifrt's modules of plain values and rules that the core may use (they import no I/O of their own at load)."""


def outside_imports(path: Path) -> list[str]:
    """What ``path`` imports anywhere in its text that the core may not: I/O, the shell, ifrt beyond its values."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        for name in names:
            first = name.split(".")[0]
            allowed = (name == "coordinator.core" or name.startswith("coordinator.core.") or name in PLAIN_IFRT
                       or (first not in IO and first not in ("coordinator", "ifrt", "plugins")))
            if not allowed:
                found.append(f"{path.name}:{node.lineno}: {name}")
    return found


def test_the_check_finds_io_a_shell_module_and_a_client_module(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("import json\nfrom coordinator.core import journal\n\n\ndef later():\n    import socket\n"
                       "    from coordinator.service import Service\n    from ifrt.client import Client\n")
    assert outside_imports(planted) == ["planted.py:6: socket", "planted.py:7: coordinator.service",
                                        "planted.py:8: ifrt.client"]


def test_no_core_module_imports_io_or_the_shell():
    modules = sorted(CORE.glob("*.py"))
    assert {"state.py", "attempts.py", "run.py", "journal.py"} <= {p.name for p in modules}
    assert [found for path in modules for found in outside_imports(path)] == []


def test_the_whole_core_loads_without_the_network_or_a_thread_of_its_own():
    names = [f"coordinator.core.{p.stem}" for p in sorted(CORE.glob("*.py")) if p.stem != "__init__"]
    loaded_code = ("import json, sys\n" + "".join(f"import {n}\n" for n in names)
                   + "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n")
    out = subprocess.run([sys.executable, "-c", loaded_code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    loaded = set(json.loads(out.stdout.splitlines()[-1]))
    assert "coordinator" in loaded
    # logging (which loads threading) and pathlib come with the interpreter's start-up here, not from the core
    assert loaded & {"asyncio", "concurrent", "etcd3aio", "grpc", "prometheus_client", "selectors", "socket",
                     "subprocess"} == set()


def test_the_replay_check_names_a_part_that_changed_outside_the_journal():
    recorder = Recorder()  # the suite's own (conftest.live_and_replayed_agree) stays installed beneath it
    recorder.install()
    try:
        state = published(n=2)
        state.attempts._replacing.add(1)  # as a decision would that applied something it did not journal
    finally:
        recorder.uninstall()
    try:
        assert recorder.differences() == ["after 2 journal entries, replacing: live [1], replayed []"]
    finally:
        state.attempts._replacing.discard(1)  # the same again, for the suite's own check of this test


def test_every_journal_entry_applies_through_exactly_one_row():
    """Live and replay share one apply per entry: the router's decisions in state.APPLY, the run's in replays.REPLAYS.
    An entry type with no row would fail its first replay; one with two would be ambiguous."""
    entries = set(typing.get_args(journal.Entry))
    assert set(APPLY).isdisjoint(REPLAYS)
    assert set(APPLY) | set(REPLAYS) == entries

