"""The SGLang rollout engine's settings (`sglang.Engine` arguments under SGLang's names)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class SGLangEngineConfig:
    """The SGLang rollout engine (`rollout_engine="sglang"`): `sglang.Engine` arguments under SGLang's `ServerArgs`
    names, so the flags are slime's (`--sglang-mem-fraction-static`, ...). Needs `sglang>=0.5.23`."""

    model_path: str | None = None
    """HF model directory the engine loads (None: the trainer's model, backend.model; it must be a directory)."""
    tp_size: int = 1
    """Tensor-parallel GPUs of the engine (slime sets it from --rollout-num-gpus-per-engine)."""
    mem_fraction_static: float = 0.6
    """Fraction of GPU memory for the engine's weights + KV cache."""
    attention_backend: str | None = None
    """SGLang attention kernels ("fa3", "triton", "flashinfer", ...; None: SGLang picks for the GPU)."""
    enable_deterministic_inference: bool = True
    """SGLang's batch-invariant mode. SGLang honours a request's `sampling_seed` only with it on, and rlbench's
    rollouts are seeded, so it is on by default; off is faster but then seeded generate calls are refused
    (unless allow_unseeded)."""
    rl_on_policy_target: str | None = None
    """SGLang's true on-policy numerics for a trainer ("fsdp", its only choice; turns deterministic inference on).
    It matches an FSDP trainer running SGLang's batch-invariant kernels, not rlbench's: see docs/rollout.md."""
    allow_unseeded: bool = False
    """With deterministic inference off, sample anyway and ignore the per-sample seeds (warned once)."""
    enable_memory_saver: bool = True
    """Needed for sleep/wake_up (SGLang's release/resume_memory_occupation)."""
    random_seed: int = 0
    """Server seed (a request's sampling_seed overrides it in deterministic mode)."""
    extra: dict = field(default_factory=dict)
    """Any other `ServerArgs` field, passed to `sglang.Engine` unchanged (JSON on the command line)."""

    def __post_init__(self) -> None:
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"sglang mem_fraction_static={self.mem_fraction_static} must be in (0, 1)")
        if self.tp_size < 1:
            raise ValueError(f"sglang tp_size={self.tp_size} must be >= 1")
        if self.rl_on_policy_target not in (None, "fsdp"):
            raise ValueError(f"sglang rl_on_policy_target={self.rl_on_policy_target!r}: SGLang 0.5.23 knows only "
                             "'fsdp' (or None)")
        named = sorted(set(self.extra) & {f.name for f in dataclasses.fields(self)})
        if named:
            raise ValueError(f"sglang extra sets {named}, which are fields of their own; set those fields instead")

    @property
    def deterministic(self) -> bool:
        """Whether SGLang runs its deterministic mode (rl_on_policy_target turns it on too)."""
        return self.enable_deterministic_inference or self.rl_on_policy_target is not None

    def engine_kwargs(self, model_path: str) -> dict:
        """Keyword arguments of `sglang.Engine(...)` for this config and model directory."""
        kwargs = dict(model_path=model_path, tp_size=self.tp_size, mem_fraction_static=self.mem_fraction_static,
                      enable_memory_saver=self.enable_memory_saver, random_seed=self.random_seed,
                      enable_deterministic_inference=self.deterministic)
        if self.attention_backend is not None:
            kwargs["attention_backend"] = self.attention_backend
        if self.rl_on_policy_target is not None:
            kwargs["rl_on_policy_target"] = self.rl_on_policy_target
        return kwargs | self.extra
