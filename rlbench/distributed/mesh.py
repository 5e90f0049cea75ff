"""Process groups and the named DeviceMesh ("dp", "cp") that every distributed component receives.

One code path for every world size: a plain `python script.py` runs as a world of one (a private
TCP rendezvous on a free port), `torchrun` or `torch.multiprocessing.spawn` supply RANK/WORLD_SIZE.
Nothing here is a module-level singleton: `init_distributed` returns a `DistEnv` that callers pass on.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits: rank, world, compute device and the (dp, cp) mesh."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh  # named ("dp", "cp"); a tp dim can be appended later
    shard_mesh: DeviceMesh  # 1-D, dp x cp flattened: FSDP shards over it so CP peers' grads are reduced

    @property
    def dp_size(self) -> int:
        return self.mesh["dp"].size()

    @property
    def cp_size(self) -> int:
        return self.mesh["cp"].size()

    @property
    def dp_rank(self) -> int:
        return self.mesh["dp"].get_local_rank()

    @property
    def cp_rank(self) -> int:
        return self.mesh["cp"].get_local_rank()

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_backend(device_type: str, cpu_offload: bool = False) -> str:
    """nccl on CUDA, gloo on CPU; the hybrid `cpu:gloo,cuda:nccl` when CUDA tensors meet CPU-offloaded ones."""
    if device_type == "cpu":
        return "gloo"
    return "cpu:gloo,cuda:nccl" if cpu_offload else "nccl"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(
    device: str = "cuda",
    *,
    cp_size: int = 1,
    cpu_offload: bool = False,
    timeout_minutes: int = 10,
) -> DistEnv:
    """Initialise torch.distributed (if needed) and build the ("dp", "cp") mesh.

    Args:
        device: "cuda" or "cpu"; on CUDA each process takes `cuda:LOCAL_RANK`.
        cp_size: context-parallel size; must divide the world size (dp = world / cp).
        cpu_offload: use the hybrid gloo+nccl backend (CPU DTensor ops such as grad-norm clipping
            of CPU-offloaded parameters need gloo).
        timeout_minutes: collective timeout.

    Returns:
        DistEnv for this process.
    """
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device={device!r} is not supported; use 'cuda' or 'cpu'")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but CUDA is not available; pass device='cpu'")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device("cuda", local_rank) if device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        _init_process_group(pick_backend(dev.type, cpu_offload), dev, timeout_minutes)
    world = dist.get_world_size()
    if cp_size < 1 or world % cp_size:
        raise ValueError(f"cp_size={cp_size} must be >= 1 and divide world_size={world}")
    mesh = init_device_mesh(dev.type, (world // cp_size, cp_size), mesh_dim_names=("dp", "cp"))
    return DistEnv(dist.get_rank(), world, local_rank, dev, mesh, flatten_dp_cp(mesh))


def _init_process_group(backend: str, dev: torch.device, timeout_minutes: int) -> None:
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        kwargs = {"device_id": dev} if dev.type == "cuda" else {}
        dist.init_process_group(backend, timeout=timeout, **kwargs)
        return
    # A world of one without a launcher: private rendezvous, same code path afterwards.
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1, timeout=timeout
    )


def flatten_dp_cp(mesh: DeviceMesh) -> DeviceMesh:
    """The flattened dp x cp sub-mesh (named "dp_cp"); FSDP shards and reduces over it."""
    sub = mesh["dp", "cp"]
    return sub._flatten("dp_cp") if sub.ndim > 1 else sub


def barrier(env: DistEnv) -> None:
    """A barrier on the default group (device-agnostic: gloo on CPU, nccl on CUDA)."""
    if env.device.type == "cuda":
        dist.barrier(device_ids=[env.device.index])
    else:
        dist.barrier()
