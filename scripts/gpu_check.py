"""The GPU check (run by scripts/gpu-check.sh): ifrt's GPU paths on this host's real GPUs, as one JSON report.

Checks, each a section of the report with ``ok`` and what it saw:

- ``nvml``: the ``cuda`` plugin through real NVML, beside ``nvidia-smi``: kind, memory, UUID, PCI bus id, NVLink
  peers and fabric state of every GPU, and the slice it chose from the fabric.
- ``visible_devices``: ``CUDA_VISIBLE_DEVICES`` forms (unset, index, UUID, UUID prefix, empty, ``-1``): the GPUs the
  plugin lists beside ``torch.cuda.device_count()`` and ``nvidia-smi -L`` under each.
- ``discover``: ``ifrt discover --plugin cuda`` against a local coordinator; more processes on the host than GPUs are
  refused with the plugin's message.
- ``torch``: ``ifrt.torch.init_process_group()`` on the GPU (NCCL, an all_reduce of a CUDA tensor, a DeviceMesh on
  cuda) beside a plain ``init_process_group("nccl")`` with env://, timed from process start.
- ``jax``: ``ifrt.jax.initialize()`` with this host's JAX (its GPU backend): JAX's device ids beside ifrt's global
  ids, a jitted computation on a mesh from ``ifrt.jax``, beside a plain ``jax.distributed.initialize``.

Exits 1 if any check failed. Each program runs in a child process of its own with a timeout, so one that hangs is
reported as such and the others still run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from typing import Any

from coordinator.local import LocalCoordinator
from plugins.cuda import CudaPlugin

CHILD_TIMEOUT_S = 120.0
ROUNDS = 2
"""Starts of each kind timed (PyTorch, JAX): the first of a kind also pays for a cold file cache."""
RESULT = "GPU-CHECK-RESULT "
"""The line a child program prints its JSON answer on (its other output goes to the report's tail)."""
PACKAGES = ("torch", "jax", "jaxlib", "nvidia-ml-py", "grpcio", "grpcio-health-checking", "protobuf", "numpy",
            "ifrt-topology")


CHECKS: dict[str, Callable[[], dict[str, Any]]] = {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="ifrt's GPU paths on this host's GPUs: one JSON report on stdout, "
                                                 "exit 1 if any check failed")
    parser.add_argument("--checks", default=",".join(CHECKS), metavar="NAME[,NAME...]",
                        help=f"which checks to run, in this order (default all: {', '.join(CHECKS)})")
    names = [n.strip() for n in parser.parse_args(argv).checks.split(",") if n.strip()]
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        parser.error(f"unknown checks {unknown}: expected some of {', '.join(CHECKS)}")
    report: dict[str, Any] = {"host": environment()}
    for name in names:
        started = time.monotonic()
        try:
            section = CHECKS[name]()
        except Exception as e:
            section = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
        section["seconds"] = round(time.monotonic() - started, 2)
        report[name] = section
    report["ok"] = all(report[name]["ok"] for name in names)
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


# What the host is.
def environment() -> dict[str, Any]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    smi = run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    return {"hostname": socket.gethostname(), "python": platform.python_version(), "kernel": platform.release(),
            "packages": versions, "nvidia_smi": smi.stdout.strip().splitlines(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


# The cuda plugin through NVML.
def check_nvml() -> dict[str, Any]:
    reason = CudaPlugin().check()
    if reason is not None:
        return {"ok": False, "error": f"the cuda plugin is unavailable: {reason}"}
    env = without_visible_devices()
    listed = child_json(LIST_DEVICES, env)
    smi = run(["nvidia-smi", "--query-gpu=uuid,pci.bus_id,memory.total", "--format=csv,noheader,nounits"], env=env)
    smi_gpus = [dict(zip(("uuid", "pci_bus_id", "memory_mib"), (f.strip() for f in line.split(",")), strict=True))
                for line in smi.stdout.strip().splitlines()]
    devices = listed["devices"]
    problems = []
    if [d["uuid"] for d in devices] != [g["uuid"] for g in smi_gpus]:
        problems.append("the plugin's GPUs are not nvidia-smi's, in its order")
    for device, gpu in zip(devices, smi_gpus, strict=False):
        if device["pci_bus_id"].lower() != gpu["pci_bus_id"].lower():
            problems.append(f"GPU {device['local_id']}: PCI bus id {device['pci_bus_id']} != {gpu['pci_bus_id']}")
        if int(device["memory_bytes"]) >> 20 != int(gpu["memory_mib"]):
            problems.append(f"GPU {device['local_id']}: {device['memory_bytes']} bytes != {gpu['memory_mib']} MiB")
    complete = all(isinstance(f, dict) and f["problem"] is None for f in listed["fabric"])
    if not complete and any(d["slice_key"] != listed["hostname"] for d in devices):
        problems.append("without a complete fabric, every GPU's slice should be the host's")
    return {"ok": not problems, "problems": problems, **listed, "nvidia_smi": smi_gpus}


LIST_DEVICES = """
import socket
from plugins.cuda import CudaPlugin
plugin = CudaPlugin()
devices = plugin.local_devices()
fabric, found = plugin.nvlink_fabric()
answer({"hostname": socket.gethostname(), "slices_from": found.source, "fabric_warnings": found.warnings,
        "devices": [{"local_id": d.local_id, "kind": d.kind, "slice_key": d.slice_key, **d.attributes,
                     **d.host_attributes} for d in devices],
        "fabric": [f if isinstance(f, str) else {**vars(f), "cluster_uuid": f.cluster_uuid.hex(),
                                                 "health": f.health(), "problem": f.problem()} for f in fabric]})
"""


# CUDA_VISIBLE_DEVICES, as the plugin, torch and nvidia-smi read it.
def check_visible_devices() -> dict[str, Any]:
    uuids = [d["uuid"] for d in child_json(LIST_DEVICES, without_visible_devices())["devices"]]
    forms: list[str | None] = [None, "0", uuids[0], uuids[0][:12], "", "-1", f"0,-1,{len(uuids) - 1}"]
    if len(uuids) > 1:
        forms += [f"{len(uuids) - 1},0", ",".join(reversed(uuids))]
    with ThreadPoolExecutor(len(forms)) as pool:
        rows = list(pool.map(visible_under, forms))
    return {"ok": all(r["agrees"] for r in rows), "gpus": len(uuids), "forms": rows,
            "note": "nvidia-smi lists every GPU whatever CUDA_VISIBLE_DEVICES says; it is shown, not compared"}


def visible_under(form: str | None) -> dict[str, Any]:
    """The GPUs the plugin, torch and nvidia-smi see under CUDA_VISIBLE_DEVICES=form (None: unset)."""
    env = without_visible_devices()
    if form is not None:
        env["CUDA_VISIBLE_DEVICES"] = form
    seen = child_json(COUNT_VISIBLE, env)
    smi = run(["nvidia-smi", "-L"], env=env)
    seen["nvidia_smi_L"] = len([line for line in smi.stdout.splitlines() if line.startswith("GPU ")])
    seen["form"] = form
    # the plugin lists what CUDA numbers, or refuses where CUDA sees nothing
    seen["agrees"] = (seen["plugin"] == seen["torch"]) if isinstance(seen["plugin"], int) else seen["torch"] == 0
    return seen


COUNT_VISIBLE = """
from plugins.cuda import CudaPlugin
try:
    plugin = [d.host_attributes["uuid"] for d in CudaPlugin().local_devices()]
    count = len(plugin)
except Exception as e:
    plugin, count = None, f"{type(e).__name__}: {e}"
import torch
answer({"plugin": count, "plugin_uuids": plugin, "torch": torch.cuda.device_count()})
"""


# ifrt discover with the cuda plugin.
def check_discover() -> dict[str, Any]:
    env = without_visible_devices()
    gpus = CudaPlugin().gpu_count()
    with LocalCoordinator(num_processes=1) as coordinator:
        done = run([sys.executable, "-X", "faulthandler", "-m", "ifrt.cli", "discover", "--coordinator",
                    coordinator.address, "--plugin", "cuda", "--json", "--timeout", "60"], env=env)
    topology = json.loads(done.stdout) if done.returncode == 0 else None
    listed = topology["devices"] if topology else []
    crowd = gpus + 1  # one process more on this host than it has GPUs
    with LocalCoordinator(num_processes=crowd) as coordinator:
        children = [subprocess.Popen(
            [sys.executable, "-m", "ifrt.cli", "discover", "--coordinator", coordinator.address, "--plugin", "cuda",
             "--timeout", "30"], env={**env, "IFRT_LOCAL_RANK": str(rank), "IFRT_LOCAL_WORLD_SIZE": str(crowd)},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(crowd)]
        refused = [finish(child) for child in children]
    expected = f"{crowd} processes on this host but only {gpus} GPUs"
    ok_refused = all(rc != 0 and expected in err for rc, _, err in refused)
    return {"ok": done.returncode == 0 and len(listed) == gpus and all(d["platform"] == "cuda" for d in listed)
            and ok_refused,
            "discover_exit": done.returncode, "discover_stderr": done.stderr[-1500:], "devices": listed,
            "slices": topology and topology.get("slices"),
            "crowded": {"processes": crowd, "expected_message": expected,
                        "answers": [{"exit": rc, "stderr": err.strip()[-400:]} for rc, _, err in refused]}}


# PyTorch.
TORCH_IFRT = """
import time, ifrt
import torch, torch.distributed as dist
import ifrt.torch
t_imported = time.time()
topology = ifrt.torch.init_process_group(timeout=60)
t_init = time.time()
x = torch.arange(4, dtype=torch.float32, device="cuda") + dist.get_rank()
dist.all_reduce(x)
torch.cuda.synchronize()
t_collective = time.time()
n = topology.num_processes
expected = [float(n * i + n * (n - 1) / 2) for i in range(4)]
firsts = [d for d in topology.devices if d.local_id == 0]  # a DeviceMesh has one entry per rank
mesh = ifrt.torch.device_mesh(topology.mesh((n,), ("dp",), devices=firsts))
answer({"backend": dist.get_backend(), "plugin_devices": [d.platform for d in topology.local_devices],
        "torch": torch.__version__, "torch_cuda": torch.version.cuda, "nccl": list(torch.cuda.nccl.version()),
        "all_reduce": x.tolist(), "expected": expected, "mesh_device_type": mesh.device_type,
        "mesh": str(mesh), "cuda_device": torch.cuda.current_device(),
        "import_s": t_imported - T0, "init_s": t_init - t_imported, "first_collective_s": t_collective - t_init,
        "start_to_first_collective_s": t_collective - T0})
dist.destroy_process_group()
"""

TORCH_PLAIN = """
import time
import torch, torch.distributed as dist
t_imported = time.time()
dist.init_process_group("nccl", init_method="env://", device_id=torch.device("cuda", 0))
t_init = time.time()
x = torch.arange(4, dtype=torch.float32, device="cuda") + dist.get_rank()
dist.all_reduce(x)
torch.cuda.synchronize()
t_collective = time.time()
answer({"backend": dist.get_backend(), "all_reduce": x.tolist(), "import_s": t_imported - T0,
        "init_s": t_init - t_imported, "first_collective_s": t_collective - t_init,
        "start_to_first_collective_s": t_collective - T0})
dist.destroy_process_group()
"""


def check_torch() -> dict[str, Any]:
    env = without_visible_devices()
    runs: dict[str, list[dict[str, Any]]] = {"ifrt": [], "plain_env": []}
    for _ in range(ROUNDS):  # alternating, so that neither start alone pays for a cold file cache
        with LocalCoordinator(num_processes=1) as coordinator:
            runs["ifrt"].append(child_json(TORCH_IFRT, {**env, "IFRT_COORDINATOR": coordinator.address}))
        runs["plain_env"].append(child_json(TORCH_PLAIN, {**env, "MASTER_ADDR": "127.0.0.1",
                                                          "MASTER_PORT": str(free_port()), "RANK": "0",
                                                          "WORLD_SIZE": "1"}))
    ours = runs["ifrt"][-1]
    ok = all(r["backend"] == "nccl" and r["all_reduce"] == r["expected"] and r["mesh_device_type"] == "cuda"
             and set(r["plugin_devices"]) == {"cuda"} for r in runs["ifrt"])
    return {"ok": ok, "ifrt": ours, "plain_env": runs["plain_env"][-1],
            "start_to_first_collective_s": timings(runs, "start_to_first_collective_s"),
            "init_s": timings(runs, "init_s")}


def timings(runs: dict[str, list[dict[str, Any]]], key: str) -> dict[str, list[float]]:
    """Each way's ``key`` in every round, in seconds."""
    return {way: [round(r[key], 3) for r in rounds] for way, rounds in runs.items()}


# JAX.
JAX_IFRT = """
import time, ifrt
import jax, jax.numpy as jnp
import ifrt.jax
from jax.sharding import NamedSharding, PartitionSpec as P
t_imported = time.time()
topology = ifrt.jax.initialize(timeout=120, plugin=PLUGIN)
t_init = time.time()
mesh = ifrt.jax.mesh(topology.mesh((len(topology.devices),), ("data",)))
x = jax.device_put(jnp.arange(8.0 * len(topology.devices)), NamedSharding(mesh, P("data")))
total = float(jax.jit(lambda v: (v * 2).sum())(x))
t_computed = time.time()
pairs = [(d, ifrt.jax.device(d.id)) for d in topology.devices]
answer({"ids": [{"ifrt_global_id": d.id, "jax_id": j.id, "ifrt_platform": d.platform, "jax_platform": j.platform,
                 "kind": d.kind, "jax_kind": j.device_kind} for d, j in pairs],
        "mesh_platforms": sorted({d.platform for d in mesh.devices.flat}), "sum": total, "jax": jax.__version__,
        "expected": float(sum(2 * i for i in range(8 * len(topology.devices)))),
        "import_s": t_imported - T0, "init_s": t_init - t_imported, "first_computation_s": t_computed - t_init,
        "start_to_first_computation_s": t_computed - T0})
"""

JAX_PLAIN = """
import time
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
t_imported = time.time()
jax.distributed.initialize(ADDRESS, num_processes=1, process_id=0)
t_init = time.time()
mesh = Mesh(jax.devices(), ("data",))
x = jax.device_put(jnp.arange(8.0 * len(jax.devices())), NamedSharding(mesh, P("data")))
total = float(jax.jit(lambda v: (v * 2).sum())(x))
t_computed = time.time()
answer({"jax_ids": [d.id for d in jax.devices()], "sum": total, "import_s": t_imported - T0,
        "init_s": t_init - t_imported, "first_computation_s": t_computed - t_init,
        "start_to_first_computation_s": t_computed - T0})
"""


def check_jax() -> dict[str, Any]:
    env = {**without_visible_devices(), "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    runs: dict[str, list[dict[str, Any]]] = {"ifrt_plugin_jax": [], "ifrt_plugin_cuda": [], "plain": []}
    for _ in range(ROUNDS):
        for plugin in ("jax", "cuda"):
            with LocalCoordinator(num_processes=1) as coordinator:
                runs[f"ifrt_plugin_{plugin}"].append(child_json(JAX_IFRT.replace("PLUGIN", repr(plugin)),
                                                                {**env, "IFRT_COORDINATOR": coordinator.address}))
        runs["plain"].append(child_json(JAX_PLAIN.replace("ADDRESS", repr(f"127.0.0.1:{free_port()}")), env))
    ok = all(r["sum"] == r["expected"] and r["mesh_platforms"] == ["gpu"]
             for way, rounds in runs.items() if way != "plain" for r in rounds)
    return {"ok": ok, **{way: rounds[-1] for way, rounds in runs.items()},
            "start_to_first_computation_s": timings(runs, "start_to_first_computation_s"),
            "init_s": timings(runs, "init_s")}


# Children and helpers.
PRELUDE = """
import json, sys, time
T0 = time.time()
def answer(value):
    print("GPU-CHECK-RESULT " + json.dumps(value), flush=True)
"""


def child_json(program: str, env: dict[str, str]) -> dict[str, Any]:
    """Runs ``program`` in a fresh interpreter (its ``answer(...)`` is returned); RuntimeError with its output
    if it fails, answers nothing or outlives CHILD_TIMEOUT_S."""
    try:
        done = subprocess.run([sys.executable, "-X", "faulthandler", "-c", PRELUDE + program], env=env,
                              capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        output = tail(e.stdout, e.stderr)
        raise RuntimeError(f"a child program hung past {CHILD_TIMEOUT_S}s; its output: {output}") from None
    answers = [line[len(RESULT):] for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode != 0 or not answers:
        raise RuntimeError(f"a child program exited {done.returncode}: {tail(done.stdout, done.stderr)}")
    result = json.loads(answers[-1])
    warnings = [line for line in done.stderr.splitlines() if "warn" in line.lower()]
    if warnings:
        result["stderr_warnings"] = warnings[-10:]
    return result


def tail(*outputs: Any) -> str:
    text_ = "\n".join(o if isinstance(o, str) else (o or b"").decode(errors="replace") for o in outputs)
    return text_.strip()[-3000:]


def run(command: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return subprocess.CompletedProcess(command, 127, "", f"{type(e).__name__}: {e}")


def finish(child: subprocess.Popen) -> tuple[int, str, str]:
    try:
        out, err = child.communicate(timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        child.kill()
        out, err = child.communicate()
        err += f"\n(killed after {CHILD_TIMEOUT_S}s)"
    return child.returncode, out, err


def without_visible_devices() -> dict[str, str]:
    """This environment without CUDA_VISIBLE_DEVICES, so every check starts from every GPU of the host."""
    return {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


CHECKS.update(nvml=check_nvml, visible_devices=check_visible_devices, discover=check_discover, torch=check_torch,
              jax=check_jax)

if __name__ == "__main__":
    sys.exit(main())
