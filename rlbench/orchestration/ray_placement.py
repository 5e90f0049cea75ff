"""Ray plumbing: lazy import, cluster start/connect, the placement group, and `gather` with a timeout.

Every remote result the driver (or an actor) waits for goes through `gather`, so a dead actor surfaces at
once and a hung collective surfaces after `timeout_s`, both as a RuntimeError naming the call and the actor.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlbench.configs.cluster import ClusterConfig, PlacementPlan

# Every process sees every GPU; an actor finds its own through ray.get_gpu_ids() (as slime does), so CUDA IPC
# handles and NCCL peers use one consistent device numbering. Except SGLang engine actors: they see only the
# tp_size GPUs they reserved (Ray's CUDA_VISIBLE_DEVICES), where SGLang puts TP rank i on visible device i.
NOSET_VISIBLE_DEVICES = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}


def import_ray():
    """`import ray`, or an ImportError that names the fix."""
    try:
        import ray
    except ImportError as e:
        raise ImportError(
            "cluster.backend='ray' needs Ray: pip install 'rlbench[dist]' (or pip install 'ray>=2.40'); "
            "or set cluster.backend='local' to run in one process"
        ) from e
    return ray


def init_ray(cluster: ClusterConfig) -> None:
    """Connect to `cluster.ray_address` / `$RAY_ADDRESS`, or start a local Ray cluster (no-op if connected)."""
    ray = import_ray()
    if ray.is_initialized():
        return
    address = cluster.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    ray.init(num_cpus=cluster.num_cpus, include_dashboard=False, log_to_driver=True)


def bundle_resources(device: str, gpus: int = 1) -> dict[str, float]:
    """A bundle of `gpus` GPUs: a GPU and a CPU each on CUDA; on a CPU run a CPU slot stands in for each GPU."""
    return {"GPU": float(gpus), "CPU": float(gpus)} if device == "cuda" else {"CPU": float(gpus)}


def check_resources(plan: PlacementPlan, device: str) -> None:
    """ValueError naming the fix when the cluster cannot hold the plan's bundles."""
    ray = import_ray()
    have = ray.cluster_resources()
    need = {k: v * sum(plan.bundle_gpus) for k, v in bundle_resources(device).items()}
    short = {k: (have.get(k, 0.0), v) for k, v in need.items() if have.get(k, 0.0) < v}
    if short:
        detail = ", ".join(f"{k}: need {v:g}, cluster has {h:g}" for k, (h, v) in short.items())
        raise ValueError(
            f"not enough resources for {plan.num_bundles} bundles ({detail}); lower actor_num_gpus_per_node / "
            "rollout_num_gpus, use colocate=True to share GPUs, or start Ray with more (ray start --num-gpus/--num-cpus)"
        )


@dataclass
class Placement:
    """The placement group and its bundles in node-major, GPU-minor order."""

    pg: Any
    """The Ray placement group."""
    order: list[int]
    """`order[i]`: Ray's bundle index of the i-th bundle in node-major order."""

    def strategy(self, position: int):
        """Scheduling strategy that pins an actor to ordered bundle `position`."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(
            placement_group=self.pg, placement_group_bundle_index=self.order[position],
            placement_group_capture_child_tasks=True,
        )


def create_placement(plan: PlacementPlan, device: str, timeout_s: float) -> Placement:
    """One PACK placement group with a bundle per GPU, ordered by (node IP, GPU id) like slime."""
    ray = import_ray()
    from ray.util.placement_group import placement_group, remove_placement_group

    check_resources(plan, device)
    bundles = [bundle_resources(device, gpus) for gpus in plan.bundle_gpus]
    pg = placement_group(bundles, strategy="PACK")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise RuntimeError(
            f"placement group of {plan.num_bundles} bundles {bundles} not ready after {timeout_s:.0f}s; "
            "the cluster is busy or too small (check `ray status`)"
        )
    if device != "cuda":
        return Placement(pg, list(range(plan.num_bundles)))
    return Placement(pg, _node_major_order(pg, plan.bundle_gpus, timeout_s))


def _node_major_order(pg, bundle_gpus: Sequence[int], timeout_s: float) -> list[int]:
    """Probe each bundle for (node IP, GPU id) and sort: IP octets, then GPU id. Bundles of one size swap places
    only with each other (an engine's multi-GPU bundle stays an engine's)."""
    ray = import_ray()
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=0, num_gpus=0.01)
    def where():
        return ray.util.get_node_ip_address(), [int(g) for g in ray.get_gpu_ids()]

    n = len(bundle_gpus)
    refs = [
        where.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)).remote()
        for i in range(n)
    ]
    infos = gather(refs, timeout_s, "placement probe", [f"bundle {i}" for i in range(n)])

    def key(i: int):
        ip, gpus = infos[i]
        return [int(x) for x in ip.split(".") if x.isdigit()], gpus[0] if gpus else 0

    order = list(range(n))
    for size in set(bundle_gpus):
        same = [i for i in range(n) if bundle_gpus[i] == size]
        for position, bundle in zip(same, sorted(same, key=key)):
            order[position] = bundle
    return order


def local_gpu_index() -> int:
    """This actor's GPU as a `cuda:` index of its process (all GPUs are visible; see NOSET_VISIBLE_DEVICES)."""
    ray = import_ray()
    gpu = str(ray.get_gpu_ids()[0])
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",").index(gpu) if visible else int(gpu)


def gather(refs: Sequence, timeout_s: float, what: str, names: Sequence[str] | None = None) -> list:
    """`ray.get` of every ref, in order, raising RuntimeError on the first failure or after `timeout_s`.

    Unlike `ray.get(refs, timeout=...)`, a dead actor is reported as soon as its ref fails, even while the other
    refs still wait on it inside a collective.
    """
    ray = import_ray()
    refs = list(refs)
    names = list(names) if names is not None else [f"#{i}" for i in range(len(refs))]
    index = {ref: i for i, ref in enumerate(refs)}
    results: list = [None] * len(refs)
    pending, deadline = list(refs), time.monotonic() + timeout_s
    while pending:
        left = deadline - time.monotonic()
        done, pending = ray.wait(pending, num_returns=1, timeout=max(left, 0.0))
        if not done:
            late = ", ".join(names[index[r]] for r in pending)
            raise RuntimeError(
                f"{what}: no result from {late} within timeout_s={timeout_s:g}s (a hung collective or a dead peer?); "
                "call trainer.close() and restart, or raise cluster.timeout_s if the work is just slow"
            )
        i = index[done[0]]
        try:
            results[i] = ray.get(done[0])
        except Exception as e:  # a RayActorError / RayTaskError: name the actor, keep the cause
            raise RuntimeError(f"{what} failed on {names[i]}: {type(e).__name__}: {e}") from e
    return results
