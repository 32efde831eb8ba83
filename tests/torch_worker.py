"""One PyTorch process of a test cluster: ``python tests/torch_worker.py``; prints one JSON object.

ifrt.torch.init_process_group() (twice), then all_reduce and all_gather on the default group, and a DeviceMesh
from an ifrt mesh in reverse process order with an all_reduce over its "tp" axis.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

import ifrt.torch

TIMEOUT = 60.0


def main() -> None:
    topology = ifrt.torch.init_process_group(timeout=TIMEOUT)
    again = ifrt.torch.init_process_group(timeout=TIMEOUT)
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    gathered = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor([float(10 * rank)]))
    reverse = topology.mesh((2, world // 2), ("dp", "tp"), devices=list(reversed(topology.devices)))
    mesh = ifrt.torch.device_mesh(reverse)
    tp_sum = torch.tensor([float(rank)])
    dist.all_reduce(tp_sum, group=mesh.get_group("tp"))
    print(json.dumps({
        "process_id": topology.process_id,
        "rank": rank,
        "world_size": world,
        "backend": dist.get_backend(),
        "same_topology_again": again is topology,
        "all_reduce": total.item(),
        "all_gather": [t.item() for t in gathered],
        "ifrt_mesh_processes": [[ifrt.split_global_id(int(i))[0] for i in row] for row in reverse.devices.tolist()],
        "device_mesh": mesh.mesh.tolist(),
        "mesh_dim_names": list(mesh.mesh_dim_names),
        "tp_sum": tp_sum.item(),
        "store_prefix": ifrt.torch.store().prefix,
    }), flush=True)
    dist.barrier()  # every rank done with the group before any tears it down (gloo aborts a peer otherwise)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
