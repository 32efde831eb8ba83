"""Finding plugins: the built-ins, then distributions' entry points in the group ``ifrt.plugins``.

A third-party package adds a device type without changing this project:

    [project.entry-points."ifrt.plugins"]
    mydevice = "mypackage.ifrt_plugin:MyDevicePlugin"

A plugin that fails to load, or whose ``check()`` raises, is reported with its name and error; it never breaks
another plugin or the listing.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib import metadata

from ifrt.errors import PluginError
from plugins.base import DevicePlugin

ENTRY_POINT_GROUP = "ifrt.plugins"
BUILTIN: dict[str, str] = {"cpu": "plugins.cpu:CpuPlugin", "sim": "plugins.sim:SimPlugin",
                           "cuda": "plugins.cuda:CudaPlugin", "jax": "plugins.jax_plugin:JaxPlugin"}
"""The built-in plugins by name, as ``module:class``: a process imports only the one it uses (the cuda plugin's
module alone costs several milliseconds of every process's start)."""


@dataclass(frozen=True)
class PluginInfo:
    """What ``ifrt plugins`` shows for one plugin."""

    name: str
    source: str
    plugin: DevicePlugin | None
    error: str | None = None

    @property
    def status(self) -> str:
        """``available``, ``unavailable: why`` (from ``check()``), or ``broken: error`` (it failed to load or check)."""
        if self.error is not None:
            return f"broken: {self.error}"
        if self.plugin is None:
            return "unavailable: not loaded"
        try:
            reason = self.plugin.check()
        except Exception as e:  # a plugin's bug is shown, never raised: one broken plugin hides nothing else
            return f"broken: plugin {self.name!r}: check() raised {type(e).__name__}: {e}"
        return "available" if reason is None else f"unavailable: {reason}"


def _entry_points() -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def _load(ep: metadata.EntryPoint) -> DevicePlugin:
    try:
        target = ep.load()
        plugin = target() if callable(target) and not isinstance(target, DevicePlugin) else target
    except Exception as e:
        raise PluginError(f"plugin {ep.name!r} ({ep.value}) failed to load: {type(e).__name__}: {e}") from e
    if not isinstance(plugin, DevicePlugin):
        raise PluginError(f"plugin {ep.name!r} ({ep.value}) is a {type(plugin).__name__}, not a DevicePlugin")
    if not plugin.name:
        plugin.name = ep.name
    return plugin


def _builtin(name: str) -> type[DevicePlugin]:
    module, cls = BUILTIN[name].split(":")
    return getattr(importlib.import_module(module), cls)


def get_plugin(name: str) -> DevicePlugin:
    """The plugin called ``name``; PluginError if it is unknown (listing the known ones) or broken."""
    if name in BUILTIN:
        return _builtin(name)()
    entry_points = _entry_points()
    if name not in entry_points:
        raise PluginError(f"unknown device plugin {name!r}: known plugins are {sorted({*BUILTIN, *entry_points})}")
    return _load(entry_points[name])


def all_plugins() -> list[PluginInfo]:
    """Every plugin found, built-in first, each loaded on its own so one broken plugin hides nothing else."""
    infos = [PluginInfo(name, "built-in", _builtin(name)()) for name in BUILTIN]
    for name, ep in sorted(_entry_points().items()):
        source = f"entry point {ep.value}" + (f" from {ep.dist.name}" if ep.dist else "")
        if name in BUILTIN:
            infos.append(PluginInfo(name, source, None, f"shadowed by the built-in plugin {name!r}"))
            continue
        try:
            infos.append(PluginInfo(name, source, _load(ep)))
        except PluginError as e:
            infos.append(PluginInfo(name, source, None, str(e)))
    return infos
