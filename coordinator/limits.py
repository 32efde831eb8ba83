"""What the coordinator accepts from a caller: every size and count it checks, each an ``ifrt-coordinator`` flag.

A request over a limit is refused with InvalidArgument naming the value, the limit and the flag that raises it,
and changes nothing. The id layout's own bound (a local id below 2**17) is not a setting: a flag may lower the
devices a process may register, never raise it past what a global id can encode.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ifrt.errors import InvalidArgument
from ifrt.ids import MAX_LOCAL_DEVICES

FLAGS = {
    "request_bytes": "--max-request-bytes",
    "devices_per_process": "--max-devices-per-process",
    "attributes_per_device": "--max-attributes",
    "string_bytes": "--max-string-bytes",
    "kv_value_bytes": "--kv-max-value-bytes",
    "kv_keys": "--kv-max-keys",
    "kv_key_bytes": "--kv-max-key-bytes",
    "barrier_name_bytes": "--max-barrier-name-bytes",
    "concurrent_streams": "--max-concurrent-streams",
}
"""The ``ifrt-coordinator`` flag that sets each limit (named in every error about it)."""


@dataclass(frozen=True)
class Limits:
    """Every limit on what callers send, with its default and the reason for it."""

    request_bytes: int = 16 << 20
    """Largest message of any call (gRPC refuses larger ones with RESOURCE_EXHAUSTED): 2**17 devices fit."""
    devices_per_process: int = MAX_LOCAL_DEVICES
    """Most devices one process registers: every local id below 2**17 (the id layout's bound, never raised)."""
    attributes_per_device: int = 64
    """Most attributes one device carries: a plugin's properties fit; thousands per device bloat every topology."""
    string_bytes: int = 1024
    """Longest hostname, address, cluster id, plugin, platform, kind, slice key, attribute key or value (UTF-8)."""
    kv_value_bytes: int = 1 << 20
    """Largest key-value value: bootstrap values (a collective's unique id, an address) are far smaller."""
    kv_keys: int = 1 << 20
    """Most keys the store holds at once: 64 for each of 2**14 processes; the store lives in memory and its journal."""
    kv_key_bytes: int = 1024
    """Longest key-value key (UTF-8): keys are names, and every one is journaled and listed."""
    barrier_name_bytes: int = 1024
    """Longest barrier name (UTF-8): names are journaled and named in every barrier's errors."""
    concurrent_streams: int = 0
    """Calls one client connection may have open at once (HTTP/2 streams); further calls wait for a free one.
    0: gRPC's own default (no limit), since one client process may hold many waiting calls over one connection."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            least = 0 if f.name == "concurrent_streams" else 1
            if not isinstance(value, int) or value < least:
                raise InvalidArgument(f"{FLAGS[f.name]} {value!r} is out of range: expected an integer >= {least}")
        if self.devices_per_process > MAX_LOCAL_DEVICES:
            raise InvalidArgument(f"{FLAGS['devices_per_process']} {self.devices_per_process} is out of range: "
                                  f"expected at most {MAX_LOCAL_DEVICES} (2**17), the local ids a global id encodes")


DEFAULT_LIMITS = Limits()
"""Every limit at its default."""


def shown(text: str, most: int = 64) -> str:
    """A caller's text as an error quotes it: its first ``most`` characters (errors travel in a status message,
    which gRPC clients refuse beyond 8 KiB of metadata)."""
    return repr(text) if len(text) <= most else f"{text[:most]!r}... ({len(text)} characters)"
