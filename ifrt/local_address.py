"""The address this host uses to reach another, for advertising what it serves (a transfer endpoint, a rendezvous):
apart from the transfer package, so that an agent or a launcher finds it without loading numpy."""

from __future__ import annotations

import socket
from collections.abc import Sequence

from ifrt.hostport import split_host_port


def local_address_toward(targets: Sequence[str]) -> str:
    """The IP this host uses to reach the first target (no packet is sent), for advertising an endpoint."""
    host, port = split_host_port(targets[0])
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, int(port)))
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())
