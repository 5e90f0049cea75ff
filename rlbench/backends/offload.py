"""sleep / wake_up: park parameters, gradients and optimizer state in host memory and free the device copy.

Instead of `module.to("cpu")` (which replaces tensors and must then be re-threaded through FSDP's
sharded views and the optimizer's param keys), every device storage is copied to host memory and then
resized to zero bytes; `wake_up` re-allocates it and copies the bytes back. Every tensor object, view
and optimizer key stays the same, and the round trip is bit-exact by construction. It works on CPU too
(the storages really are freed), so the round trip is testable without a GPU.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Parameters, their gradients and optimizer state tensors (local shards)."""
    out: list[torch.Tensor] = []
    for p in model.parameters():
        out.append(_local(p))
        if p.grad is not None:
            out.append(_local(p.grad))
    if optimizer is not None:
        for state in optimizer.state.values():
            out.extend(_local(v) for v in state.values() if isinstance(v, torch.Tensor))
    return out


def to_device(obj: Any, device: torch.device) -> Any:
    """Move a tensor, or the tensor fields of a dataclass / dict, to `device` (other values unchanged). Host
    tensors go to a GPU through pinned memory: an asynchronous copy from pageable memory may wait for the stream."""
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "cpu" and torch.device(device).type == "cuda" and not obj.is_pinned():
            obj = obj.pin_memory()
        return obj.to(device, non_blocking=True)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: to_device(getattr(obj, f.name), device) for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


class Parking:
    """A backend's sleep / wake_up: its training state parked in host memory between colocated turns.

    Both backends call `park(tensors, device, barrier)` from `sleep()` and `unpark(barrier)` from `wake_up()`;
    `asleep` guards the methods that need the state on the device.
    """

    def __init__(self) -> None:
        self.stash = HostStash()
        self.asleep = False

    def park(self, tensors: list[torch.Tensor], device: torch.device, barrier) -> dict[str, float]:
        """Copy `tensors`' storages to host memory and free them; `barrier()` after. Returns memory/perf metrics."""
        if self.asleep:
            raise ValueError("sleep() called twice; call wake_up() first")
        t0 = time.perf_counter()
        allocated = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
        moved = self.stash.offload(tensors, device)
        self.asleep = True
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        barrier()
        freed = allocated - torch.cuda.memory_allocated(device) if allocated is not None else moved
        return {"memory/sleep_moved_bytes": float(moved), "memory/freed_bytes": float(freed),
                "perf/sleep_time": time.perf_counter() - t0}

    def unpark(self, barrier) -> dict[str, float]:
        """Bring the parked storages back (bit-exact); `barrier()` after. Returns memory/perf metrics."""
        t0 = time.perf_counter()
        restored = self.stash.restore()
        self.asleep = False
        barrier()
        return {"memory/wake_restored_bytes": float(restored), "perf/wake_up_time": time.perf_counter() - t0}


class HostStash:
    """Host copies of the device storages behind a set of tensors (one entry per distinct storage)."""

    def __init__(self) -> None:
        self._entries: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
        self._pool: list[torch.Tensor] = []  # host buffers kept after restore: pinning GBs is slow, reuse them

    @property
    def nbytes(self) -> int:
        return sum(host.numel() for _, host in self._entries)

    def offload(self, tensors: list[torch.Tensor], device: torch.device) -> int:
        """Copy each live storage on `device` to host memory, then free it. Returns bytes freed."""
        assert not self._entries, "offload() twice without restore()"
        seen: set[int] = set()
        pin = device.type == "cuda"
        for t in tensors:
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if t.device != device or storage.nbytes() == 0 or key in seen:
                continue
            seen.add(key)
            host = self._host_buffer(len(self._entries), storage.nbytes(), pin)
            host.copy_(_bytes_view(storage), non_blocking=pin)
            self._entries.append((storage, host))
        if pin:
            torch.cuda.synchronize(device)
        for storage, _ in self._entries:
            storage.resize_(0)
        return self.nbytes

    def restore(self) -> int:
        """Re-allocate every stashed storage and copy its bytes back. Returns bytes restored."""
        restored = self.nbytes
        for storage, host in self._entries:
            storage.resize_(host.numel())
            _bytes_view(storage).copy_(host, non_blocking=host.is_pinned())
        if self._entries and self._entries[0][0].device.type == "cuda":
            torch.cuda.synchronize(self._entries[0][0].device)
        self._pool = [host for _, host in self._entries]
        self._entries.clear()
        return restored

    def _host_buffer(self, i: int, nbytes: int, pin: bool) -> torch.Tensor:
        if i < len(self._pool) and self._pool[i].numel() == nbytes:
            return self._pool[i]
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),))
