"""Device plugins, by name. Built-ins: ``cpu``."""

from __future__ import annotations

from plugins.base import DevicePlugin
from plugins.cpu import CpuPlugin

_BUILTIN: dict[str, type[DevicePlugin]] = {CpuPlugin.name: CpuPlugin}


def get_plugin(name: str) -> DevicePlugin:
    """The plugin called ``name``; ValueError listing the known names if there is none."""
    try:
        return _BUILTIN[name]()
    except KeyError:
        raise ValueError(f"unknown device plugin {name!r}: known plugins are {sorted(_BUILTIN)}") from None


__all__ = ["DevicePlugin", "get_plugin"]
