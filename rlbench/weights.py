"""Bucketed weight sync from the trainer (TrainBackend) into the rollout engine (RolloutEngine).

The backend yields its full (unsharded) weights as buckets of `(hf_name, tensor)` pairs, each at most
`bucket_bytes` (a single larger tensor gets a bucket of its own); a transport hands the buckets to the
engine one at a time, so at most one bucket of gathered weights is alive at once (bounded peak memory).
Each sync stamps a new policy version on the engine; samples record the version that generated them.

Here trainer and engine share one process (`InProcessTransport`: the engine copies each bucket into its own
parameters); the Ray paths (CUDA IPC colocated, NCCL broadcast disaggregated) are `rlbench.orchestration.ray_weights`,
consuming the same bucket stream.

    sync = WeightSync(WeightSyncConfig(bucket_bytes=256 << 20, verify=True), backend, engine)
    metrics = sync.push(version=3)   # perf/update_weights_time, weights/bytes, weights/num_buckets, ...
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from rlbench.configs import WeightSyncConfig

Bucket = list[tuple[str, torch.Tensor]]


class InProcessTransport:
    """Same process, same device: pass the bucket tensors to `engine.update_weights` by reference."""

    def push(self, buckets: Iterable[Bucket], engine, version: int) -> None:
        engine.update_weights(buckets, version)




@dataclass
class SyncTally:
    """What went through one sync (filled while the engine consumes the bucket stream)."""

    num_buckets: int = 0
    num_tensors: int = 0
    bytes: int = 0
    max_bucket_bytes: int = 0
    send_time: float = 0.0
    """Seconds spent sending (transports that time their sends fill it)."""

    def add(self, bucket: Bucket) -> None:
        nbytes = bucket_nbytes(bucket)
        self.num_buckets += 1
        self.num_tensors += len(bucket)
        self.bytes += nbytes
        self.max_bucket_bytes = max(self.max_bucket_bytes, nbytes)

    def metrics(self) -> dict[str, float]:
        return {"weights/bytes": float(self.bytes), "weights/num_buckets": float(self.num_buckets),
                "weights/num_tensors": float(self.num_tensors), "weights/max_bucket_bytes": float(self.max_bucket_bytes)}


def bucket_nbytes(bucket: Bucket) -> int:
    """Total bytes of the tensors in a bucket."""
    return sum(t.numel() * t.element_size() for _, t in bucket)


def _counted(buckets: Iterable[Bucket], tally: SyncTally, limit: int, checksums: dict | None) -> Iterator[Bucket]:
    """Pass buckets through lazily, counting them and checking the size bound (and checksumming)."""
    for bucket in buckets:
        nbytes = bucket_nbytes(bucket)
        assert nbytes <= limit or len(bucket) == 1, f"bucket of {nbytes} B exceeds bucket_bytes={limit}"
        tally.add(bucket)
        if checksums is not None:
            checksums.update((name, checksum(t)) for name, t in bucket)
        yield bucket


def checksum(t: torch.Tensor) -> tuple[int, int]:
    """Exact, order-independent fingerprint of a tensor's bits: (Σ v_i, Σ v_i·(i mod 65521)) in wrapping int64.

    `v` is the tensor's raw bit pattern read as int16/int32/int64, so any changed bit changes the sum with
    overwhelming probability and equal tensors give equal sums on any device.
    """
    int_dtype = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    v = t.detach().contiguous().view(-1).view(int_dtype).to(torch.int64)  # [N]
    pos = torch.arange(v.numel(), device=v.device, dtype=torch.int64) % 65521  # [N]
    return int(v.sum().item()), int((v * pos).sum().item())


def engine_named_weights(engine) -> Iterator[tuple[str, torch.Tensor]]:
    """The engine's current weights by HF name, for verification.

    Uses `engine.named_weights()` when the engine has it, else the HF names of `engine.model`
    (tied aliases such as `lm_head.weight` included).
    """
    if hasattr(engine, "named_weights"):
        return iter(engine.named_weights())
    model = engine.model
    return itertools.chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False))


class WeightSync:
    """Pushes the backend's weights into the engine, bucket by bucket, and stamps a version.

    Args:
        cfg: this component's config.
        backend: a TrainBackend (`named_weights_for_sync(bucket_bytes, dtype)` yields buckets).
        engine: a RolloutEngine (`update_weights(buckets, version)`).
    """

    def __init__(self, cfg: WeightSyncConfig, backend, engine) -> None:
        self.cfg = cfg
        self.backend = backend
        self.engine = engine
        # one process: buckets by reference; the Ray paths (CUDA IPC, NCCL broadcast) are rlbench.orchestration's
        self.transport = InProcessTransport()

    def push(self, version: int) -> dict[str, float]:
        """Sync all weights and set the engine's version to `version`.

        Returns:
            `perf/update_weights_time` (s), `weights/bytes`, `weights/num_buckets`, `weights/num_tensors`,
            `weights/max_bucket_bytes`, `weights/version` (and `weights/verified` = 1.0 when verify is on).

        Raises:
            RuntimeError: verify is on and a tensor in the engine differs from what was sent.
        """
        tally = SyncTally()
        sums: dict[str, tuple[int, int]] | None = {} if self.cfg.verify else None
        start = time.perf_counter()
        dtype = self.cfg.torch_dtype or getattr(self.engine, "dtype", None)  # cast before sending, not after
        buckets = self.backend.named_weights_for_sync(self.cfg.bucket_bytes, dtype)
        self.transport.push(_counted(buckets, tally, self.cfg.bucket_bytes, sums), self.engine, version)
        _synchronize()
        elapsed = time.perf_counter() - start
        assert tally.num_buckets > 0, "backend.named_weights_for_sync yielded no buckets"
        metrics = {"perf/update_weights_time": elapsed, **tally.metrics(), "weights/version": float(version)}
        if sums is not None:
            verify_checksums(sums, dict(engine_named_weights(self.engine)))
            metrics["weights/verified"] = 1.0
        return metrics


def verify_checksums(sent: dict[str, tuple[int, int]], engine_weights: dict[str, torch.Tensor]) -> None:
    """Raise if any sent tensor is missing from the engine or differs bitwise from it."""
    missing = sorted(set(sent) - set(engine_weights))
    if missing:
        raise RuntimeError(f"weight sync verify: engine has no weights named {missing[:5]} (of {len(missing)})")
    bad = [name for name, ref in sent.items() if checksum(engine_weights[name]) != ref]
    if bad:
        raise RuntimeError(
            f"weight sync verify: {len(bad)} tensors differ after sync, e.g. {bad[:5]}; "
            "the engine did not load what the trainer sent (dtype cast or name mapping?)"
        )


def _synchronize() -> None:
    """Wait for queued device copies so the sync time is the real time."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


# ------------------------------------------------------- the disaggregated wire format (SGLang 0.5.23's)
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float64: "float64",
                torch.int64: "int64", torch.int32: "int32", torch.bool: "bool", torch.uint8: "uint8"}
DTYPES = {v: k for k, v in DTYPE_NAMES.items()}

GROUP_NAME = "rlbench"
"""The weight-broadcast group's name: the prefix of its store keys, the same on the trainer and every engine."""
LOAD_FORMAT = "flattened_bucket"
"""How a bucket travels: "flattened_bucket" (one uint8 broadcast per bucket) or None (one broadcast per tensor),
SGLang's `load_format` of `update_weights_from_distributed`; rlbench's own engines receive both too."""


def announce(bucket: Bucket, load_format: str | None = LOAD_FORMAT) -> dict:
    """What the engines are told before a bucket is broadcast: SGLang's `update_weights_from_distributed` arguments
    `names`, `dtypes` (torch attribute names), `shapes`, `load_format`, in the order the tensors travel.

    For "flattened_bucket" the tensors go largest itemsize first, so every tensor's byte offset is a multiple of
    its itemsize: SGLang refuses an unaligned one before receiving (srt/weight_sync/tensor_bucket.py:98-101),
    which would leave the sender waiting.
    """
    if load_format not in (None, "flattened_bucket"):
        raise ValueError(f"load_format={load_format!r}: SGLang receives None (per tensor) or 'flattened_bucket'")
    if load_format == "flattened_bucket":
        bucket = sorted(bucket, key=lambda item: -item[1].element_size())  # stable: same-dtype order kept
    return {"names": [n for n, _ in bucket], "dtypes": [DTYPE_NAMES[t.dtype] for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket], "load_format": load_format}


def check_announcement(meta: dict, shapes: dict[str, tuple[int, ...]] | None = None, dtype: str | None = None) -> None:
    """Raise ValueError unless `meta` can be received as announced (and, when given, matches the engine's `shapes`
    by name and its parameter `dtype`): a receiver that fails before its broadcast leaves the sender waiting."""
    names, dtypes, sizes = meta["names"], meta["dtypes"], meta["shapes"]
    if not names or not len(names) == len(dtypes) == len(sizes):
        raise ValueError(f"weight announcement of {len(names)} names, {len(dtypes)} dtypes, {len(sizes)} shapes: "
                         "SGLang needs one of each per tensor, at least one")
    offset = 0
    for name, dtype_name, shape in zip(names, dtypes, sizes):
        if dtype_name not in DTYPES:
            raise ValueError(f"{name}: dtype {dtype_name!r} is not one of {sorted(DTYPES)} (torch attribute names)")
        if shapes is not None and name not in shapes:
            raise ValueError(f"{name} is not a tensor of the engine's checkpoint (name mapping?)")
        if shapes is not None and tuple(shape) != tuple(shapes[name]):
            raise ValueError(f"{name} announced with shape {list(shape)}, the engine holds {list(shapes[name])}")
        if dtype is not None and dtype_name != dtype:
            raise ValueError(f"{name} announced as {dtype_name}, the engine holds {dtype}: cast before sending "
                             "(weights.dtype)")
        itemsize = DTYPES[dtype_name].itemsize
        if meta["load_format"] == "flattened_bucket" and offset % itemsize:
            raise ValueError(f"{name}: byte offset {offset} of the flattened bucket is not a multiple of its itemsize "
                             f"{itemsize} (SGLang refuses it); order the bucket with announce()")
        offset += math.prod(shape) * itemsize
