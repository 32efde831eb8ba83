"""``host:port`` addresses split and joined one way everywhere, IPv6 literals in brackets ("[fe80::1]:8476")."""

from __future__ import annotations


def split_host_port(address: str) -> tuple[str, str]:
    """(host without brackets, port text) of an address; the port is "" when there is no colon.

    "node001:8476" -> ("node001", "8476"); "[fe80::1]:8476" -> ("fe80::1", "8476"); "node001" -> ("node001", "").
    The port is not checked: callers that need a number check it (``port.isdigit()``) or let ``int`` refuse it.
    """
    host, sep, port = address.rpartition(":")
    if not sep:
        return address, ""
    return host.strip("[]"), port


def join_host_port(host: str, port: int | str) -> str:
    """"node001", 8476 -> "node001:8476"; an IPv6 literal gets brackets: "fe80::1", 8476 -> "[fe80::1]:8476"."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
