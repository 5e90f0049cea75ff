"""sleep / wake_up: park parameters, gradients and optimizer state in host memory and free the device copy.

Instead of `module.to("cpu")` (which replaces tensors and must then be re-threaded through FSDP's
sharded views and the optimizer's param keys), every device storage is copied to host memory and then
resized to zero bytes; `wake_up` re-allocates it and copies the bytes back. Every tensor object, view
and optimizer key stays the same, and the round trip is bit-exact by construction. It works on CPU too
(the storages really are freed), so the round trip is testable without a GPU.
"""

from __future__ import annotations

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
