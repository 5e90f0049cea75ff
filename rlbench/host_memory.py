"""CPU runs: keep freed large host blocks in the process instead of handing them back to the OS.

glibc serves an allocation above its mmap threshold (128 KiB, adapting up to 32 MiB) with a fresh `mmap` and
unmaps it on free, and trims the heap top above 128 KiB. A CPU training step allocates and frees tensors of tens
to hundreds of MB many times (the `[rows, 152k]` logits, their gradient, the sampler's noise), so every such
tensor is page-faulted in again, 4 KiB at a time, by the kernel: on the 2-core dev box that was half of the
process's time (`sys` ~ `user`) and made the engine's sampling 5x slower than the arithmetic. With both
thresholds raised, freed blocks stay in the heap and the next tensor of the size reuses them, as the CUDA caching
allocator does on a GPU. The cost: the process keeps its peak host memory until it exits.
"""

from __future__ import annotations

import ctypes
import functools
import platform

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
LIMIT = 2**31 - 1
"""Both thresholds (mallopt takes an int): blocks below 2 GiB come from the heap and stay there when freed."""


@functools.cache
def retain_freed_host_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once); False where the C library is not glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(M_MMAP_THRESHOLD, LIMIT)) and bool(libc.mallopt(M_TRIM_THRESHOLD, LIMIT))
