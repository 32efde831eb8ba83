"""How ``ifrt.torch`` starts a process group: the device plugin and backend it picks, the device NCCL runs on, the
start-up exchange that scopes c10d's keys to one start, and the network interface gloo and NCCL use."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from typing import Any

import torch

from ifrt import startup
from ifrt.client import Client
from ifrt.hostport import split_host_port
from ifrt.interfaces import interface_of
from ifrt.local_address import local_address_toward
from ifrt.topology import Topology

log = logging.getLogger("ifrt.torch")

SOCKET_IFNAME_ENVS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
CUDA_PLATFORMS = frozenset({"cuda", "gpu"})


def default_plugin() -> str:
    """``cuda`` where this torch is built for CUDA and NVML sees a GPU, else ``cpu``. Asked of NVML, not of CUDA,
    whose runtime must not start before the plugin has given each local rank its GPUs (CUDA_VISIBLE_DEVICES)."""
    if torch.version.cuda is None:
        return "cpu"  # without importing the cuda plugin
    from plugins.cuda import CudaPlugin

    return "cuda" if CudaPlugin().gpu_count() > 0 else "cpu"


def nccl_device(backend: str, topology: Topology) -> Any:
    """The CUDA device NCCL runs this process's rank on: its first GPU (local ids are CUDA's numbering of the
    visible GPUs); None for other backends."""
    if "nccl" not in backend or not topology.local_devices:
        return None
    device = torch.device("cuda", topology.local_devices[0].local_id)
    torch.cuda.set_device(device)
    return device


def default_backend(topology: Topology) -> str:
    """nccl where this process's devices are CUDA GPUs, else gloo."""
    if topology.local_devices and all(d.platform in CUDA_PLATFORMS for d in topology.local_devices):
        return "nccl"
    return "gloo"


class StartupExchange(startup.StartupExchange):
    """torch.distributed's start-up exchange (``ifrt.startup``): its nonce scopes c10d's keys to this start
    (``ifrt/torch/gG/N0/c10d/...``)."""

    runtime, what = "torch", "torch.distributed start-up"

    def run(self) -> str:
        """The c10d key prefix of this start, once every process has answered it."""
        self.exchange({})
        return f"{self.scope}/c10d/"

    def describe_keys(self, keys: Sequence[str]) -> str:
        """Who should set c10d's ``keys``: those ending in a rank (``.../<rank>``) name that rank's process."""
        by_rank = [p.process_id for p in self.topology.processes]
        named = sorted({by_rank[int(m.group(1))] for k in keys if (m := re.search(r"(?:/|_)(\d+)$", k))
                        and int(m.group(1)) < len(by_rank)})
        if not named:
            return ""
        return "expected from " + ", ".join(f"process {p} ({self.host(p)})" for p in named)


# The network interface gloo and NCCL use.
def advertised_ip(client: Client, topology: Topology) -> str:
    """The IP this process is reached at: its transfer endpoint's host, else its address toward the coordinator."""
    address = topology.process(topology.process_id).address
    host = split_host_port(address)[0]
    return host or local_address_toward(client.settings.coordinators)


def set_socket_interfaces(ip: str) -> None:
    """GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME name the interface of ``ip``, unless the user set them (gloo would
    otherwise pick the interface of the hostname, which across hosts is often not the one ifrt advertises)."""
    name = interface_of(ip)
    if name is None:
        log.warning("no network interface has address %s: gloo and NCCL choose their own", ip)
        return
    for env in SOCKET_IFNAME_ENVS:
        os.environ.setdefault(env, name)
