"""Device plugins: what each process reports about its own devices. See ``plugins.registry``."""

from __future__ import annotations

from ifrt.errors import PluginError
from plugins.base import DevicePlugin
from plugins.registry import ENTRY_POINT_GROUP, PluginInfo, all_plugins, get_plugin

__all__ = ["ENTRY_POINT_GROUP", "DevicePlugin", "PluginError", "PluginInfo", "all_plugins", "get_plugin"]
