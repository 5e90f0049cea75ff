"""The megatron backend on one GPU against the FSDP backend: same weights, same packs (`pytest -m gpu`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from rlbench.backends.fsdp.actor import FSDPBackend  # noqa: E402
from rlbench.backends.megatron import MegatronBackend, MegatronConfig  # noqa: E402
from rlbench.configs.backend import FSDPOptions, TrainConfig  # noqa: E402
from rlbench.packing.pack import pack_samples  # noqa: E402
from rlbench.types import Sample  # noqa: E402


def _pack(vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = [(300, 120), (517, 200), (96, 40), (1024, 512)]
    samples = [Sample(tokens=torch.randint(0, vocab, (n,), generator=g).tolist(), response_length=r) for n, r in lengths]
    return pack_samples(samples, pad_multiple=128)


def _loss(logp, ent, inputs):
    return -(logp * inputs["w"]).sum() - 0.01 * (ent * inputs["w"]).sum(), {}


CASES = [("fp32", "sdpa"), ("bf16", "flex"), ("bf16", "sdpa")]
"""(param dtype, attention) of the comparison."""


def backend_configs(dtype: str, attn: str) -> tuple[TrainConfig, MegatronConfig, TrainConfig]:
    """megatron's configs and FSDP's, the same but for FSDP's own options (megatron refuses them)."""
    cfg = TrainConfig(model="small", device="cuda", param_dtype=dtype, with_entropy=True)
    fsdp = FSDPOptions(compile=False, attn_implementation="sdpa" if attn == "sdpa" else "flex_attention")
    return cfg, MegatronConfig(attention=attn), dataclasses.replace(cfg, fsdp=fsdp)


@pytest.mark.parametrize("dtype,attn", CASES)
def test_megatron_matches_fsdp_on_gpu(dtype, attn):
    """Log-probs / entropy at T = 0.8 and two training steps (entropy term): fp32 to 1e-5, bf16 to bf16 rounding."""
    cfg, megatron, fsdp_cfg = backend_configs(dtype, attn)
    mb = MegatronBackend(cfg, megatron, temperature=0.8)
    mb.init()
    fb = FSDPBackend(fsdp_cfg, env=mb.env, temperature=0.8)
    fb.init()
    pack = _pack(128)
    a, b = fb.compute_log_prob([pack], with_entropy=True)[0], mb.compute_log_prob([pack], with_entropy=True)[0]
    tol = 1e-5 if dtype == "fp32" else 0.1
    logp_diff = float((a.log_probs - b.log_probs).abs().max())
    ent_diff = float((a.entropy - b.entropy).abs().max())
    w = torch.full((pack.response_index.numel(),), 1.0 / pack.response_index.numel())
    steps = [(fb.train([pack], [{"w": w}], loss_fn=_loss), mb.train([pack], [{"w": w}], loss_fn=_loss)) for _ in range(2)]
    after = float((fb.compute_log_prob([pack])[0].log_probs - mb.compute_log_prob([pack])[0].log_probs).abs().max())
    print(f"{dtype}/{attn}: logp {logp_diff:.2e} ent {ent_diff:.2e}; losses "
          f"{[(f['train/loss'], m['train/loss']) for f, m in steps]}; grad norms "
          f"{[(f['train/grad_norm'], m['train/grad_norm']) for f, m in steps]}; logp after 2 steps {after:.2e}")
    assert logp_diff <= tol and ent_diff <= tol * 10
    for f, m in steps:
        assert m["train/skipped"] == 0.0
        assert abs(f["train/loss"] - m["train/loss"]) <= tol * max(1.0, abs(f["train/loss"]))
        assert abs(f["train/grad_norm"] - m["train/grad_norm"]) <= (1e-4 if dtype == "fp32" else 0.05) * f["train/grad_norm"]
    assert after <= (1e-4 if dtype == "fp32" else 0.2)
    sync_m = dict(p for bucket in mb.named_weights_for_sync(64 << 20, dtype=None) for p in bucket)
    sync_f = dict(p for bucket in fb.named_weights_for_sync(64 << 20, dtype=None) for p in bucket)
    assert sorted(sync_m) == sorted(sync_f)
    before = mb.compute_log_prob([pack])[0].log_probs
    moved = mb.sleep()["memory/sleep_moved_bytes"]
    mb.wake_up()
    assert moved > 0 and torch.equal(before, mb.compute_log_prob([pack])[0].log_probs)
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
