"""The torch runtime of ``pipeline.py``: a ``PipelineParallel`` module whose stage i lives on ifrt device i, and
the conversions that carry torch tensors over ``ifrt.transfer.Channels`` as numpy arrays without copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ifrt.records import Device
from ifrt.transfer import Channels

CARRIER = {torch.bfloat16: torch.int16}
"""Torch dtypes numpy lacks, sent as a numpy dtype of the same width (the bit pattern) and viewed back."""


def torch_device(device: Device) -> torch.device:
    """Where torch holds tensors of an ifrt device: its CUDA ordinal for the ``cuda`` plugin, else the host."""
    return torch.device("cuda", device.local_id) if device.platform == "cuda" else torch.device("cpu")


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """``tensor``'s host memory as a numpy array, not copied (a device tensor is copied to the host once)."""
    host = tensor.detach().to("cpu").contiguous()
    return host.view(CARRIER.get(host.dtype, host.dtype)).numpy()


def from_numpy(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The tensor of ``dtype`` that ``to_numpy`` made ``array`` from, sharing ``array``'s memory."""
    tensor = torch.from_numpy(array)
    if tensor.dtype != CARRIER.get(dtype, dtype):
        raise TypeError(f"received an array of {array.dtype} for an activation of {dtype}: expected "
                        f"{CARRIER.get(dtype, dtype)}")
    return tensor.view(dtype)


def mlp_stage(layers: Sequence[np.ndarray], dtype: torch.dtype) -> torch.nn.Sequential:
    """``x -> tanh(x @ w)`` for each ``w`` of ``layers``, as torch modules of ``dtype``."""
    modules: list[torch.nn.Module] = []
    for w in layers:
        linear = torch.nn.Linear(*w.shape, bias=False, dtype=dtype)
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(w.T))  # Linear computes x @ weight.T
        modules += [linear, torch.nn.Tanh()]
    return torch.nn.Sequential(*modules)


class PipelineParallel(torch.nn.Module):
    """Stage i of ``stages`` on ifrt device ``devices[i]``: this process keeps and runs the stages on its own
    devices, and ``forward`` moves each activation to the next stage's device (over a socket to another process)."""

    def __init__(self, stages: Sequence[torch.nn.Module], devices: Sequence[int], channels: Channels,
                 dtype: torch.dtype) -> None:
        super().__init__()
        if len(stages) != len(devices):
            raise ValueError(f"{len(stages)} stages but {len(devices)} devices: expected one device per stage")
        topology = channels.topology
        self.devices = [topology.device(d) for d in devices]
        self.local = [d.process_id == topology.process_id for d in self.devices]
        self.stages = torch.nn.ModuleDict({str(i): stage.to(torch_device(self.devices[i]))
                                           for i, stage in enumerate(stages) if self.local[i]})
        self.channels, self.dtype = channels, dtype

    @torch.no_grad()
    def forward(self, x: torch.Tensor | None = None) -> torch.Tensor | None:
        """Runs this process's stages on one (micro)batch: ``x`` is the input where stage 0 runs (None elsewhere);
        returns the last stage's output where it runs, None elsewhere."""
        last = len(self.devices) - 1
        for i, device in enumerate(self.devices):
            if not self.local[i]:
                continue
            if i == 0:
                x = x.to(torch_device(device))
            elif not self.local[i - 1]:
                received = self.channels.recv(self.devices[i - 1].id, device.id)
                x = from_numpy(received, self.dtype).to(torch_device(device))
            x = self.stages[str(i)](x)
            if i == last:
                return x
            after = self.devices[i + 1]
            if self.local[i + 1]:
                x = x.to(torch_device(after))
            else:
                self.channels.send(to_numpy(x), after.id, device.id)
                x = None
        return None
