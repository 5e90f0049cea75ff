"""megatron-core on the CPU: its hard-coded CUDA calls redirected, inside megatron's own modules only.

megatron-core is a CUDA library: about a hundred of its modules allocate with `device="cuda"` or
`torch.cuda.current_device()`, read `torch.cuda` RNG state, or sync streams (the list from reading 0.16/0.19:
`../shared/reference/megatron-notes.md` §2). None of that is TransformerEngine or a kernel; on a CPU box
(CI, a laptop, the notebooks at smoke size) the same math runs once those calls mean "the CPU".

`run_on_cpu()` rebinds the name `torch` in every loaded `megatron.core` module to `CPUTorch`, a view of torch whose
tensor factories map a CUDA device to the CPU and whose `torch.cuda` answers with the CPU's generator, no-op
syncs and streams. torch itself, rlbench and every other library are untouched (but see below). The backend calls it only for
`device="cpu"`; on a GPU nothing is rebound. Once run, megatron in this process runs on the CPU (a process uses
one device).

A rebound module name cannot reach a tensor's own methods: the tied-embedding sync of pipeline parallelism
(`weight.data.cuda()`, `language_module.py`) and the distributed optimizer's constructor (`param.type() ==
"torch.cuda.FloatTensor"` when it builds its shards). Those megatron methods (`_TENSOR_METHOD_CALLS`) run inside
`cuda_tensor_methods()`: for the duration of the call (and only then) `Tensor.cuda()` of a CPU tensor is the
tensor and `Tensor.type()` names a CPU tensor's CUDA type. bf16/fp16 stay refused on CPU: megatron's
mixed-precision path would take CPU tensors for CUDA ones throughout, not in a few calls.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import types

import torch

_FACTORIES = frozenset({
    "zeros", "ones", "empty", "full", "tensor", "arange", "zeros_like", "ones_like", "empty_like", "full_like",
    "rand", "randn", "randint", "as_tensor", "eye", "linspace",
})


def _cpu(device):
    """A CUDA device (name, index or torch.device) -> "cpu"; anything else unchanged."""
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _on_cpu(fn):
    def call(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        return fn(*args, **kwargs)

    return call


class _DeviceMeta(type):
    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, torch.device)

    def __call__(cls, kind, index=None):
        kind = _cpu(kind)
        return torch.device(kind) if index is None or str(kind) == "cpu" else torch.device(kind, index)


class _Device(metaclass=_DeviceMeta):
    """`torch.device` whose CUDA devices are the CPU (isinstance checks still see a torch.device)."""


class _NullStream:
    def synchronize(self) -> None: ...
    def wait_stream(self, stream) -> None: ...
    def wait_event(self, event) -> None: ...
    def record_event(self, event=None): return _NullEvent()


class _NullEvent:
    def __init__(self, *args, **kwargs) -> None: ...
    def record(self, stream=None) -> None: ...
    def synchronize(self) -> None: ...
    def wait(self, stream=None) -> None: ...
    def query(self) -> bool: return True
    def elapsed_time(self, other) -> float: return 0.0


def _cuda_on_cpu() -> types.SimpleNamespace:
    """What megatron calls on `torch.cuda`, answered by the CPU; the rest of `torch.cuda` as it is."""
    ns = types.SimpleNamespace(**{k: getattr(torch.cuda, k) for k in dir(torch.cuda) if not k.startswith("__")})
    null = _NullStream()
    ns.__dict__.update(
        current_device=lambda: "cpu", device_count=lambda: 0, synchronize=lambda *a, **k: None,
        current_stream=lambda *a, **k: null, default_stream=lambda *a, **k: null, Stream=lambda *a, **k: null,
        stream=lambda *a, **k: contextlib.nullcontext(), Event=_NullEvent,
        get_rng_state=lambda *a, **k: torch.get_rng_state(), set_rng_state=lambda state, *a, **k: torch.set_rng_state(state),
        manual_seed=lambda seed: torch.manual_seed(seed), manual_seed_all=lambda seed: torch.manual_seed(seed),
        memory_allocated=lambda *a, **k: 0, max_memory_allocated=lambda *a, **k: 0, empty_cache=lambda: None,
        nvtx=types.SimpleNamespace(range_push=lambda *a, **k: None, range_pop=lambda *a, **k: None,
                                   range=lambda *a, **k: contextlib.nullcontext()),
    )
    return ns


class CPUTorch(types.ModuleType):
    """`torch` as megatron-core sees it on a CPU box (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _cuda_on_cpu()
        self.device = _Device

    def __getattr__(self, name: str):
        value = getattr(torch, name)
        return _on_cpu(value) if name in _FACTORIES else value


@contextlib.contextmanager
def cuda_tensor_methods():
    """For the block: `Tensor.cuda()` of a CPU tensor returns it, `Tensor.type()` (no argument) of a CPU tensor
    names the CUDA type ('torch.cuda.FloatTensor'). Not thread-safe: the backend's megatron calls run on one
    thread, and the originals are back when the block ends, raised or not."""
    cuda, type_of = torch.Tensor.cuda, torch.Tensor.type

    def on_cpu(t, *args, **kwargs):
        return t if t.device.type == "cpu" else cuda(t, *args, **kwargs)

    def cuda_name(t, dtype=None, non_blocking=False, **kwargs):
        if dtype is not None or kwargs:
            return type_of(t, dtype, non_blocking, **kwargs)
        name = type_of(t)
        return name.replace("torch.", "torch.cuda.", 1) if t.device.type == "cpu" else name

    own = {name: torch.Tensor.__dict__[name] for name in ("cuda", "type") if name in torch.Tensor.__dict__}
    torch.Tensor.cuda, torch.Tensor.type = on_cpu, cuda_name
    try:
        yield
    finally:
        for name in ("cuda", "type"):  # back to exactly what was there (inherited from TensorBase, or own)
            if name in own:
                setattr(torch.Tensor, name, own[name])
            else:
                delattr(torch.Tensor, name)


def _within_cuda_tensor_methods(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with cuda_tensor_methods():
            return fn(*args, **kwargs)

    call.rlbench_cpu = True
    return call


_TENSOR_METHOD_CALLS = (
    ("megatron.core.models.common.language_module.language_module", "LanguageModule",
     "setup_embeddings_and_output_layer"),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer", "__init__"),
)
"""(module, class, method) of megatron that call a tensor's `.cuda()` or compare its `.type()` to a CUDA name."""

_INSTALLED: set[str] = set()


def run_on_cpu() -> None:
    """Point every loaded `megatron.core` module's `torch` at `CPUTorch` (idempotent; new modules on re-call)."""
    import megatron.core.tensor_parallel.random as mrandom

    view = CPUTorch()
    for name, module in list(sys.modules.items()):
        if name in _INSTALLED or not name.startswith("megatron.core") or module is None:
            continue
        if getattr(module, "torch", None) is torch:
            module.torch = view
        _INSTALLED.add(name)
    # the RNG tracker reads and writes generator states through these two helpers (default argument "cuda")
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    for module_name, cls_name, method in _TENSOR_METHOD_CALLS:
        cls = getattr(importlib.import_module(module_name), cls_name)
        fn = cls.__dict__[method]
        if not getattr(fn, "rlbench_cpu", False):
            setattr(cls, method, _within_cuda_tensor_methods(fn))
