"""``host:port`` addresses split and joined one way everywhere, IPv6 literals in brackets ("[fe80::1]:8476")."""

from __future__ import annotations

import ipaddress
import re

from ifrt.errors import InvalidArgument

MAX_SOCKET_PATH = 107
"""The longest path a Unix socket may have (the kernel's sun_path holds 108 bytes, its terminating NUL included)."""


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


EXPECTED = ("HOST:PORT: a host name, an IPv4 address or an IPv6 address in brackets, a colon and a port from 1 to "
            "65535 (node001:8476, 10.0.0.2:8476, [fe80::1]:8476)")
"""The form an advertised address takes, as errors name it."""
_NAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9._-]*[A-Za-z0-9_])?\.?")
_MAX_NAME = 253
_SHOWN = 80


def address_problem(address: str, *, bind: bool = False) -> str | None:
    """What makes ``address`` not HOST:PORT (see ``EXPECTED``), or None. With ``bind`` it is where to listen: the
    host may be empty (every interface) and the port 0 (any free one)."""
    host, sep, port = address.rpartition(":")
    if not sep:
        return "it has no port"
    if not port.isascii() or not port.isdigit() or not (0 if bind else 1) <= int(port) <= 65535:
        return f"port {port!r} is not a number from {0 if bind else 1} to 65535"
    if host.startswith("[") and host.endswith("]"):
        literal = host[1:-1]
        try:
            ipaddress.IPv6Address(literal.split("%")[0])
        except ValueError:
            return f"{host!r} is not an IPv6 address in brackets"
        return None
    if ":" in host:
        return f"host {host!r} has a colon: an IPv6 address goes in brackets"
    if not host:
        return None if bind else "it has no host"
    if len(host) > _MAX_NAME or not _NAME.fullmatch(host):
        return (f"host {host[:_SHOWN]!r} is not a host name or an address (letters, digits, '.', '-' and '_', at "
                f"most {_MAX_NAME})")
    return None


def check_address(address: str, what: str, *, bind: bool = False) -> str:
    """``address`` if it is HOST:PORT (``address_problem``); else InvalidArgument naming ``what``, the value, what is
    wrong and the expected form."""
    problem = address_problem(address, bind=bind)
    if problem is not None:
        shown = repr(address[:_SHOWN]) + (f" ({len(address)} characters)" if len(address) > _SHOWN else "")
        raise InvalidArgument(f"{what} {shown} is not an address: {problem}; expected {EXPECTED}"
                              + (", or an empty host and port 0 to listen anywhere" if bind else ""))
    return address


def check_host(host: str, what: str) -> str:
    """``host`` if it is a host name or an address (IPv6 without brackets); else InvalidArgument naming ``what``."""
    problem = address_problem(join_host_port(host, 1))
    if problem is not None:
        raise InvalidArgument(f"{what} {host[:_SHOWN]!r} is not a host name or an address: expected letters, digits, "
                              "'.', '-' and '_' (node001), an IPv4 address (10.0.0.2) or an IPv6 address (fe80::1)")
    return host
