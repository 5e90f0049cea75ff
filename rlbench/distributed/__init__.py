"""Process groups and the (dp, cp) DeviceMesh."""

from rlbench.distributed.mesh import DistEnv, barrier, flatten_dp_cp, init_distributed, pick_backend

__all__ = ["DistEnv", "barrier", "flatten_dp_cp", "init_distributed", "pick_backend"]
