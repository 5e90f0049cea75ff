"""The batch-1 decode megakernel: a batch-1 step's decoder layers as stage kernels that stream the weights
(`host.DecodeMegakernel` over `triton_stages.py`, `gluon_gemv.py`, `gluon_attend.py`), its head as two Triton
kernels (`head.py`), the state update as one (`step.py`); `layout.py` holds the constants.

The engine's runner calls `build` once with its `MegakernelConfig` and drives what it returns.
"""

from __future__ import annotations

import warnings

import torch

from rlbench.configs.engine import MegakernelConfig
from rlbench.engine.megakernel.host import DecodeMegakernel, default_stage_sync, unsupported


class BatchOneDecoder:
    """A batch-1 decode step's kernels for one model and KV cache: `layers` runs every decoder layer of slot 0
    (hidden `[1, 1, D]` in and out), `head` (None: the compiled head samples) the final norm, lm_head, sampling
    and state update."""

    def __init__(self, layers: DecodeMegakernel, head=None):
        self.layers, self.head = layers, head

    def step(self, embed, state, mode: str, max_pos: int) -> bool:
        """Slot 0's whole decode step, every layer then the head kernels, where they cover `mode` (greedy and
        sampling steps): `embed(tokens, positions) -> (hidden, cos, sin)` is the runner's prologue, `state` its
        `SlotState`. False, with nothing run, where the compiled head must sample (top-k/top-p, or no head)."""
        if self.head is None or mode == "truncate":
            return False
        positions = state.positions[:1]
        self.head(self.layers(*embed(state.tokens[:1], positions), positions), state, mode, max_pos)
        return True

    def finish_step(self, state, b: int, tokens: torch.Tensor, log_probs: torch.Tensor, max_pos: int) -> bool:
        """On CUDA, the state update of slots `[0, b)` as one Triton kernel (`step.finish_step`); False elsewhere
        (the caller's torch ops do it)."""
        if not state.tokens.is_cuda:
            return False
        from rlbench.engine.megakernel.step import finish_step

        finish_step(state, b, tokens, log_probs, max_pos)
        return True

    def bind(self, layers: list, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor]) -> bool:
        """Point the kernels at these weights and caches (not inside a graph capture). True when batch-1 CUDA
        graphs captured before must be dropped: something moved, and Gluon stages hold TMA descriptors of the old
        addresses as kernel parameters."""
        return self.layers.bind(layers, k_cache, v_cache) and bool(self.layers.gluon_active())

    def unbind(self) -> None:
        """Forget the bound weights, so that their memory can be freed; the next `bind` binds afresh."""
        self.layers.unbind()

    def check(self) -> None:
        """Raise if a launch since the last check timed out at a grid barrier (its tokens are invalid)."""
        self.layers.check()


def build(model: torch.nn.Module, base: torch.nn.Module, layers: list | None, max_seq_len: int,
          device: torch.device, cfg: MegakernelConfig) -> BatchOneDecoder | None:
    """The batch-1 decoder `cfg` asks for over `model` (`base`: its decoder, holding the final norm; `layers`: its
    fused layers, None when unfused), or None: batch 1 takes the compiled path. Off unless `cfg.enabled` is True
    or None with PDL stage sync; warns where `cfg` asks for what cannot run here."""
    if cfg.enabled is False:
        return None
    reason = unsupported(model, layers, device)
    sync = default_stage_sync(device) if cfg.sync == "auto" else cfg.sync
    if reason is not None or not (cfg.enabled or sync == "pdl"):
        if cfg.enabled:
            warnings.warn(f"megakernel=True has no effect: {reason}; batch 1 decodes on the compiled path",
                          stacklevel=3)
        return None
    kernel = DecodeMegakernel(model, layers, max_seq_len, device)
    kernel.stage_sync = sync
    head = None
    # the head kernels compute an RMSNorm and a linear head without bias
    if cfg.head and getattr(model.lm_head, "bias", None) is None and hasattr(base.norm, "variance_epsilon"):
        from rlbench.engine.megakernel.head import SampleHead

        head = SampleHead(model, base, device)
    if cfg.gluon is False:
        kernel.gluon_gemv = False
    elif cfg.gluon and not kernel.gluon_active():
        warnings.warn("MegakernelConfig(gluon=True) has no effect here (needs sm_90+, Triton's Gluon, a per-stage "
                      "sync and a GEMV tile that fits shared memory); the Triton stages run", stacklevel=3)
    return BatchOneDecoder(kernel, head)
