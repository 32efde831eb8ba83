"""scripts/gpu_check.py on a host without a GPU: every check it runs says why it failed, and it exits 1 (the GPU
host's results are in docs/benchmarks.md, "On a GPU")."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"


def test_without_a_gpu_each_check_names_what_is_missing_and_the_exit_is_1():
    done = subprocess.run([sys.executable, str(SCRIPT), "--checks", "nvml,discover"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] is False and set(report) == {"host", "nvml", "discover", "ok"}
    assert report["host"]["packages"]["ifrt-topology"]
    assert "the cuda plugin is unavailable" in report["nvml"]["error"]
    assert report["discover"]["ok"] is False
    assert "device plugin 'cuda'" in report["discover"]["discover_stderr"]


def test_an_unknown_check_is_refused_by_name():
    done = subprocess.run([sys.executable, str(SCRIPT), "--checks", "nvml,nccl"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert "unknown checks ['nccl']: expected some of nvml, visible_devices, discover, torch, jax" in done.stderr
