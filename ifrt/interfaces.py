"""This host's network interfaces: which one holds an address (gloo and NCCL are told the interface ifrt
advertises)."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable


def interface_of(ip: str, interfaces: Iterable[tuple[str, str]] | None = None) -> str | None:
    """The name of the interface that has address ``ip`` (``interfaces``: (name, address) pairs, default this
    host's), or None."""
    wanted = ipaddress.ip_address(ip)
    for name, address in interfaces if interfaces is not None else _host_interfaces():
        if ipaddress.ip_address(address) == wanted:
            return name
    return None


def _host_interfaces() -> list[tuple[str, str]]:
    """(name, address) of every interface address of this host: IPv4 by ioctl, IPv6 from /proc/net/if_inet6."""
    import fcntl
    import socket
    import struct

    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue  # no IPv4 address
            found.append((name, socket.inet_ntoa(raw[20:24])))
    try:
        with open("/proc/net/if_inet6") as lines:
            for line in lines:
                fields = line.split()
                found.append((fields[5], str(ipaddress.IPv6Address(bytes.fromhex(fields[0])))))
    except OSError:
        pass
    return found
