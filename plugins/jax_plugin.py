"""The ``jax`` plugin: the devices JAX's default backend has, or will have, in this process.

Optional extra ``ifrt-topology[jax]``. ``jax.distributed.initialize`` must run before any JAX backend exists,
so this plugin never creates one in the caller's process. It lists devices in the first way that applies:

- ``backend``: this process already has a JAX backend; its ``jax.local_devices()``.
- ``config``: the backend will be CPU (``JAX_PLATFORMS`` starts with ``cpu``, or no accelerator plugin is
  installed): ``jax_num_cpu_devices`` (``JAX_NUM_CPU_DEVICES``), else ``--xla_force_host_platform_device_count``
  in ``XLA_FLAGS``, else 1 device. Reads configuration only: well under a millisecond.
- ``child``: anything else (GPU, TPU): a short-lived child process lists ``jax.local_devices()`` and exits. It
  costs what importing JAX and creating its backend cost (1-2 s on CPU, more on accelerators); its answer is
  kept for the life of the process.

Local ids are positions in that list. JAX's own device id is not recorded: it changes once
``jax.distributed`` starts (``ifrt.jax.device`` maps ifrt ids to JAX devices). TPU coordinates, core on chip
and slice index are published where the platform has them; the local hardware id only means something on this
host and stays in ``host_attributes``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pkgutil
import re
import subprocess
import sys
from collections.abc import Sequence
from functools import cache
from importlib import metadata
from typing import Any

from ifrt.errors import InvalidArgument
from ifrt.records import LocalDevice
from plugins.base import DevicePlugin, select

PLATFORMS_ENV = "JAX_PLATFORMS"  # e.g. JAX_PLATFORMS=cpu
XLA_FLAGS_ENV = "XLA_FLAGS"  # e.g. XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_dump_to=/tmp"
HOST_DEVICE_COUNT = re.compile(r"--xla_force_host_platform_device_count[= ](\d+)")
CHILD_TIMEOUT_S = 300.0
_CHILD_SCRIPT = """\
import json, jax
print(json.dumps([{"platform": d.platform, "kind": d.device_kind,
                   "hardware_id": getattr(d, "local_hardware_id", None),
                   "coords": list(getattr(d, "coords", None) or ()),
                   "core_on_chip": getattr(d, "core_on_chip", None),
                   "slice_index": getattr(d, "slice_index", None)} for d in jax.local_devices()]))
"""


def backend_exists() -> bool:
    """Whether this process already created a JAX backend (after which ``jax.distributed`` cannot start)."""
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge
    except ImportError:
        return False
    check = getattr(xla_bridge, "backends_are_initialized", None)
    if check is not None:
        return bool(check())
    return bool(getattr(xla_bridge, "_backends", None))  # older JAX: the dict of created backends


def listing_method() -> str:
    """How ``visible_devices`` lists devices here: ``backend``, ``config`` or ``child`` (see the module doc)."""
    if backend_exists():
        return "backend"
    return "config" if _backend_will_be_cpu() else "child"


def visible_devices(method: str | None = None) -> list[LocalDevice]:
    """The devices JAX's default backend has, or will have, in this process; never creates a backend here.

    ``method`` forces one way of listing (``config`` or ``child``; ``backend`` only when one exists).
    """
    method = method or listing_method()
    if method == "backend":
        import jax

        return [_record(i, d.platform, d.device_kind, getattr(d, "local_hardware_id", None),
                        getattr(d, "coords", None), getattr(d, "slice_index", None), getattr(d, "core_on_chip", None))
                for i, d in enumerate(jax.local_devices())]
    if method == "config":
        return [LocalDevice(i, "cpu", "cpu") for i in range(cpu_device_count())]
    if method == "child":
        return [_record(i, d["platform"], d["kind"], d["hardware_id"], d["coords"], d["slice_index"],
                        d.get("core_on_chip"))
                for i, d in enumerate(_child_listing(*_child_key()))]
    raise InvalidArgument(f"unknown jax device listing method {method!r}: expected backend, config or child")


def jax_config(name: str, default: Any = None) -> Any:
    """A JAX option's current value, or ``default`` where this JAX version has no such option."""
    import jax

    values = getattr(jax.config, "values", {})  # every option by name (flag-style ones have no attribute)
    return values[name] if name in values else getattr(jax.config, name, default)


def cpu_device_count() -> int:
    """The number of CPU devices JAX's CPU backend will create, from configuration alone."""
    configured = jax_config("jax_num_cpu_devices", -1)  # absent before JAX 0.4.3x
    if configured is not None and configured >= 0:
        return int(configured)
    found = HOST_DEVICE_COUNT.findall(os.environ.get(XLA_FLAGS_ENV, ""))
    return int(found[-1]) if found else 1  # XLA parses the flags in order: the last one wins


class JaxPlugin(DevicePlugin):
    """Whatever devices JAX's default backend has (or will have) in this process."""

    name = "jax"

    def check(self) -> str | None:
        if importlib.util.find_spec("jax") is None:
            return "jax is not installed (pip install 'ifrt-topology[jax]')"
        return None

    def local_devices(self, local_device_ids: Sequence[int] | None = None) -> list[LocalDevice]:
        reason = self.check()
        if reason is not None:
            raise InvalidArgument(f"the jax plugin cannot list devices here: {reason}")
        return select(visible_devices(), local_device_ids)


def _record(local_id: int, platform: str, kind: str, hardware_id: int | None, coords: Any,
            slice_index: int | None, core_on_chip: int | None = None) -> LocalDevice:
    """One device as JAX describes it. Published: coordinates, slice, core on chip (which of a chip's cores
    it is, where a chip shows several). Kept on this host: the local hardware id (an index into this host's
    devices)."""
    # CPU devices have no hardware to name: their attributes stay empty whichever way they were listed.
    hardware = platform != "cpu"
    attributes = {"core_on_chip": str(core_on_chip)} if hardware and core_on_chip is not None else {}
    host_only = {"local_hardware_id": str(hardware_id)} if hardware and hardware_id is not None else {}
    return LocalDevice(local_id, platform, kind, slice_key="" if slice_index is None else str(slice_index),
                       coordinates=tuple(int(c) for c in coords or ()), attributes=attributes,
                       host_attributes=host_only)


def _backend_will_be_cpu() -> bool:
    platforms = jax_config("jax_platforms") or os.environ.get(PLATFORMS_ENV, "")
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    return not _accelerator_plugins()


def _accelerator_plugins() -> list[str]:
    """The PJRT plugins JAX would try besides CPU (libtpu, ``jax_plugins`` modules and entry points)."""
    found = [ep.name for ep in metadata.entry_points(group="jax_plugins")]
    if importlib.util.find_spec("libtpu") is not None:
        found.append("libtpu")
    try:
        import jax_plugins  # the namespace package JAX's plugins install into
    except ImportError:
        return found
    return found + [m.name for m in pkgutil.iter_modules(jax_plugins.__path__)]


def _child_key() -> tuple[str, tuple[tuple[str, str], ...]]:
    """What the child's answer depends on: this process's JAX platform setting and its environment."""
    return jax_config("jax_platforms") or "", tuple(sorted(os.environ.items()))


@cache
def _child_listing(platforms: str, environ: tuple[tuple[str, str], ...]) -> list[dict[str, Any]]:
    env = dict(environ)
    if platforms:
        env[PLATFORMS_ENV] = platforms  # set with jax.config.update in this process: the child must see it too
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD_SCRIPT], env=env, capture_output=True, text=True,
                              timeout=CHILD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise InvalidArgument(f"listing JAX's devices in a child process failed: {e}") from e
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise InvalidArgument(f"listing JAX's devices in a child process failed (exit {done.returncode}): {tail}")
    return json.loads(done.stdout.strip().splitlines()[-1])
