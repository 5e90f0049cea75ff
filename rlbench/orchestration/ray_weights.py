"""Weight sync between processes: flattened per-dtype buckets over CUDA IPC (colocated) or a broadcast group
(disaggregated). The in-process path lives in `rlbench.weights`; these transports run inside Ray actors.

Both transports consume the same stream as `rlbench.weights.WeightSync`: the TrainBackend's
`named_weights_for_sync(bucket_bytes, dtype)` buckets (a collective: every trainer rank iterates). A bucket is
flattened into one contiguous 1-D buffer per dtype plus `(name, shape, offset)` metadata, so an engine receives
ONE call per bucket (IPC) or one broadcast per dtype per bucket (not one per tensor). At most one bucket of
gathered weights (plus its flat copy) is alive at a time, and every call carries the policy version.

    colocated      trainer rank r --IPC handle of the flat buffer--> engine r (same GPU; zero-copy open)
    disaggregated  trainer rank 0 --broadcast(flat, src=0)--> engines 1..E (NCCL on GPU, gloo on CPU)

On CPU the "IPC handle" is a shared-memory file (torch's file_system sharing strategy), so the colocated
code path runs in CPU tests too.
"""

from __future__ import annotations

import datetime
import io
import pickle
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlbench.weights import Bucket, bucket_nbytes, checksum
from rlbench.weights import SyncTally as _SyncTally

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float64: "float64",
                torch.int64: "int64", torch.int32: "int32", torch.bool: "bool", torch.uint8: "uint8"}
_DTYPES = {v: k for k, v in _DTYPE_NAMES.items()}


@dataclass
class FlatBucket:
    """The tensors of one dtype of a bucket, concatenated: `buffer [N]` + where each tensor lives in it."""

    buffer: torch.Tensor  # [N] contiguous, one dtype
    names: list[str]
    shapes: list[tuple[int, ...]]
    offsets: list[int]  # element offset of each tensor; tensor i is buffer[offsets[i] : offsets[i] + numel_i]

    def meta(self) -> dict:
        """Everything but the data (what an engine needs to allocate and unflatten)."""
        return {"dtype": _DTYPE_NAMES[self.buffer.dtype], "numel": self.buffer.numel(), "names": self.names,
                "shapes": self.shapes, "offsets": self.offsets}


def flatten_bucket(bucket: Bucket) -> list[FlatBucket]:
    """One FlatBucket per dtype (in first-seen order); tensors keep their bucket order inside it."""
    by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, t in bucket:
        by_dtype.setdefault(t.dtype, []).append((name, t))
    flats = []
    for items in by_dtype.values():
        sizes = [t.numel() for _, t in items]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        buffer = torch.cat([t.detach().reshape(-1) for _, t in items])  # [N]
        flats.append(FlatBucket(buffer, [n for n, _ in items], [tuple(t.shape) for _, t in items], offsets))
    return flats


def unflatten(buffer: torch.Tensor, meta: dict) -> Bucket:
    """Views into `buffer [N]`, one per tensor of `meta` (no copy)."""
    out = []
    for name, shape, offset in zip(meta["names"], meta["shapes"], meta["offsets"]):
        numel = int(torch.Size(shape).numel())
        out.append((name, buffer[offset : offset + numel].view(shape)))
    return out


def empty_flat(meta: dict, device: torch.device) -> torch.Tensor:
    """A receive buffer `[N]` for a FlatBucket described by `meta`."""
    return torch.empty(meta["numel"], dtype=_DTYPES[meta["dtype"]], device=device)


# ---------------------------------------------------------------------------------------------- IPC (colocated)
def use_shared_memory_files() -> None:
    """CPU tensors then pickle to a shared-memory file name (openable by any local process), not an fd."""
    import torch.multiprocessing as mp

    mp.set_sharing_strategy("file_system")


def to_ipc(t: torch.Tensor) -> bytes:
    """A handle to `t`'s memory: a CUDA IPC handle on GPU, a shared-memory file on CPU. Keep `t` alive until used."""
    from multiprocessing.reduction import ForkingPickler

    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(t)
    return buf.getvalue()


def from_ipc(handle: bytes) -> torch.Tensor:
    """Open a `to_ipc` handle (zero-copy on the same GPU)."""
    return pickle.loads(handle)


def ipc_payload(bucket: Bucket) -> tuple[list[tuple[bytes, dict]], list[FlatBucket]]:
    """(`[(handle, meta)]` per dtype, the FlatBuckets the handles point into: keep them until the engine is done)."""
    flats = flatten_bucket(bucket)
    return [(to_ipc(f.buffer), f.meta()) for f in flats], flats


def load_ipc_payload(engine, payload: list[tuple[bytes, dict]], version: int) -> int:
    """Engine side: open each handle, unflatten, `engine.update_weights`; returns the bytes loaded."""
    bucket: Bucket = []
    for handle, meta in payload:
        bucket += unflatten(from_ipc(handle), meta)
    engine.update_weights([bucket], version)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # the copies out of the sender's memory are done before it frees the buffer
    return bucket_nbytes(bucket)


# ------------------------------------------------------------------------------------ broadcast (disaggregated)
class BroadcastGroup:
    """A process group of trainer rank 0 (rank 0 here) and the engines (ranks 1..E), separate from the trainer's
    default group: its own TCPStore rendezvous and its own gloo/NCCL communicator (slime's weight-update group).
    """

    def __init__(self, host: str, port: int, rank: int, world_size: int, device: torch.device, timeout_s: float):
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.world_size, self.device = rank, world_size, device
        self.store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(self.store, rank, world_size, opts)
        else:
            self.pg = dist.ProcessGroupGloo(self.store, rank, world_size, timeout)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """In-place broadcast of `tensor` from `src` (blocks until done)."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        self.pg.broadcast([tensor], opts).wait()
        if tensor.is_cuda:
            torch.cuda.synchronize(tensor.device)


def receive_broadcast(engine, group: BroadcastGroup, metas: list[dict], version: int) -> int:
    """Engine side of one bucket: receive each dtype's flat buffer, unflatten, `engine.update_weights`."""
    bucket: Bucket = []
    for meta in metas:
        buf = empty_flat(meta, group.device)
        group.broadcast(buf, src=0)
        bucket += unflatten(buf, meta)
    engine.update_weights([bucket], version)
    return bucket_nbytes(bucket)


# --------------------------------------------------------------------------------------------- sender side
class SyncTally(_SyncTally):
    """What one trainer rank pushed in one sync, with its send time."""

    def metrics(self) -> dict[str, float]:
        return super().metrics() | {"perf/update_weights_send_time": self.send_time}


def push_ipc(buckets: Iterable[Bucket], engine, version: int, wait, checksums: dict | None = None) -> SyncTally:
    """Colocated: one `engine.load_ipc.remote(payload, version)` per bucket; `wait(ref)` blocks (with a timeout)
    before the flat buffers are freed, so at most one flat bucket exists at a time."""
    tally = SyncTally()
    for bucket in buckets:
        tally.add(bucket)
        if checksums is not None:
            checksums.update((n, checksum(t)) for n, t in bucket)
        start = time.perf_counter()
        payload, flats = ipc_payload(bucket)
        wait(engine.load_ipc.remote(payload, version))
        del payload, flats
        tally.send_time += time.perf_counter() - start
    return tally


def push_broadcast(
    buckets: Iterable[Bucket], engines: list, group: BroadcastGroup | None, version: int, wait,
    checksums: dict | None = None,
) -> SyncTally:
    """Disaggregated, trainer rank 0 (`group` set): per bucket, tell every engine what comes, broadcast each dtype's
    flat buffer, wait for the engines. Other ranks (`group` None) only take part in the gathers."""
    tally = SyncTally()
    for bucket in buckets:
        if group is None:
            continue
        tally.add(bucket)
        if checksums is not None:
            checksums.update((n, checksum(t)) for n, t in bucket)
        start = time.perf_counter()
        flats = flatten_bucket(bucket)
        refs = [e.receive_weights.remote([f.meta() for f in flats], version) for e in engines]
        for f in flats:
            group.broadcast(f.buffer.to(group.device), src=0)
        wait(refs)
        tally.send_time += time.perf_counter() - start
    return tally
