"""True on-policy mode on CUDA (Triton GEMM/RMSNorm/logsumexp/attention): engine log-probs, decoded with CUDA
graphs and continuous batching, equal the trainer-side recompute bit for bit; at Qwen3-0.6B and 4B layer shapes."""

from __future__ import annotations

import copy

import pytest
import torch
from test_true_on_policy import TEMPERATURE, packed_logprobs, padded_logprobs

from rlbench import numerics
from rlbench.engine import SamplingParams, TorchEngine, TorchEngineConfig
from rlbench.models import build_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _bitwise(gens, recomputed) -> tuple[int, float]:
    """(tokens differing, max |diff|)."""
    diffs = torch.cat([(torch.tensor(g.log_probs) - lp.float().cpu()).abs() for g, lp in zip(gens, recomputed)])
    return int((diffs > 0).sum()), float(diffs.max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("preset", ["qwen3-0.6b-shape", "qwen3-4b-shape"])
def test_engine_equals_packed_and_padded_recompute_on_cuda(preset, dtype):
    model = build_model(preset, device="cuda", dtype=dtype, seed=0, num_hidden_layers=2)
    trainer = numerics.make_batch_invariant(copy.deepcopy(model)).eval()
    engine = TorchEngine(model, TorchEngineConfig(max_seq_len=512, num_slots=6, steps_per_sync=8, batch_invariant=True))
    assert engine.runner.cuda_graphs
    g = torch.Generator().manual_seed(0)
    lengths = [5, 130, 64, 200, 17, 96, 255, 33]
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    gens = engine.generate(prompts, SamplingParams(temperature=TEMPERATURE, max_new_tokens=40, n=2, seed=4))
    seqs = [(prompts[x.prompt_index], x.token_ids) for x in gens]
    with torch.device("cuda"):  # the recompute helpers' tensors are made on the GPU
        packed = packed_logprobs(trainer, seqs)
        padded = padded_logprobs(trainer, seqs[:6])
        split = packed_logprobs(trainer, seqs[:5]) + packed_logprobs(trainer, seqs[5:])
    for name, rec, gs in (("packed", packed, gens), ("padded", padded, gens[:6]), ("split", split, gens)):
        n_diff, worst = _bitwise(gs, rec)
        assert n_diff == 0, f"{preset} {dtype} {name}: {n_diff} tokens differ, max |diff| {worst:.3e}"


def test_default_numerics_differ_on_cuda():
    """Negative control: the default engine (compiled fused decode) vs an SDPA recompute, bf16."""
    model = build_model("qwen3-0.6b-shape", device="cuda", dtype=torch.bfloat16, seed=0, num_hidden_layers=2)
    trainer = copy.deepcopy(model).eval()
    engine = TorchEngine(model, TorchEngineConfig(max_seq_len=256, num_slots=6))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (9, 40, 77)]
    gens = engine.generate(prompts, SamplingParams(temperature=TEMPERATURE, max_new_tokens=32, n=2, seed=4))
    with torch.device("cuda"):
        rec = packed_logprobs(trainer, [(prompts[x.prompt_index], x.token_ids) for x in gens], invariant=False)
    n_diff, worst = _bitwise(gens, rec)
    print(f"default numerics: {n_diff} tokens differ, max |diff| {worst:.3e}")
    assert n_diff > 0
