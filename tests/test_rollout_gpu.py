"""The torch engine on CUDA: compiled + graph-captured decode against HF (run with `pytest -m gpu -s`)."""

from __future__ import annotations

import pytest
import torch

from rlbench.engine import SamplingParams, TorchEngine, TorchEngineConfig
from rlbench.models import build_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _prompts(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def _hf_greedy(model, prompt, new):
    ids = torch.tensor([prompt], device="cuda")
    out = model.generate(ids, do_sample=False, max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
                         attention_mask=torch.ones_like(ids))
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def _full_logits(model, prompt, response):
    """Logits `[R, V]` float32 predicting each response token, from one forward of prompt + response."""
    return model(torch.tensor([prompt + response], device="cuda")).logits[0, len(prompt) - 1 : -1].float()


def _logprob_diffs(model, prompts, gens, temperature):
    diffs = []
    for g in gens:
        logits = _full_logits(model, prompts[g.prompt_index], g.token_ids)
        ref = torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(g.token_ids, device="cuda")[:, None])
        diffs.append((ref[:, 0] - torch.tensor(g.log_probs, device="cuda")).abs())
    return torch.cat(diffs)


def test_compiled_graphs_fp32_greedy_equals_hf(no_tf32):
    """fp32 (TF32 off), compile + CUDA graphs, 6 prompts through 4 slots: token-for-token equal to HF greedy."""
    model = build_model("small", device="cuda", dtype=torch.float32)
    engine = TorchEngine(model, TorchEngineConfig(max_seq_len=128, num_slots=4, compile=True, cuda_graphs=True))
    prompts = _prompts([5, 17, 33, 9, 60, 2], model.config.vocab_size)
    out = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=32))
    assert engine.runner.cuda_graphs and engine.runner.compiled, "compile/graph capture fell back (see warnings)"
    assert engine.runner._graphs
    for p, g in zip(prompts, out):
        assert g.token_ids == _hf_greedy(model, p, 32)
    d = _logprob_diffs(model, prompts, out, 1.0)
    print(f"\nfp32 compiled: logprob |diff| max {d.max():.3e} mean {d.mean():.3e}")
    assert d.max() < 1e-4


def test_qwen3_06b_bf16_greedy_and_logprobs():
    """bf16 Qwen3-0.6B shape (random init), graphs: greedy == HF greedy up to bf16 near-ties; logprob stats.

    A random-init 0.6B model has a top-2 logit gap below ~0.02 at several % of the steps, so bf16 rounding
    can flip a greedy choice; every divergence from HF must therefore sit at such a near-tie.
    """
    model = build_model("qwen3-0.6b-shape", device="cuda", dtype=torch.bfloat16)
    engine = TorchEngine(model, TorchEngineConfig(max_seq_len=256, num_slots=6, compile=False, cuda_graphs=True))
    lengths = [16, 40, 7, 100, 64, 23, 150, 31]
    prompts = _prompts(lengths, model.config.vocab_size)
    new = 24
    out = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=new))
    assert engine.runner.cuda_graphs and engine.runner._graphs
    exact, worst_gap = 0, 0.0
    for p, g in zip(prompts, out):
        hf = _hf_greedy(model, p, new)
        if g.token_ids == hf:
            exact += 1
            continue
        d = next(i for i, (a, b) in enumerate(zip(g.token_ids, hf)) if a != b)
        logits = _full_logits(model, p, g.token_ids[: d + 1])[-1]  # reference logits at the divergence
        gap = float(logits[hf[d]] - logits[g.token_ids[d]])
        worst_gap = max(worst_gap, abs(gap))
        print(f"prompt len {len(p)}: first divergence at token {d}, HF-vs-ours logit gap {gap:.4f}")
    print(f"\nbf16 0.6b greedy: {exact}/{len(prompts)} prompts identical to HF; worst tie gap {worst_gap:.4f}")
    assert worst_gap < 0.25  # divergences only at bf16-level near-ties
    sampled = engine.generate(prompts, SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=new, n=2, seed=1))
    d = _logprob_diffs(model, prompts, sampled, 0.8)
    print(f"bf16 0.6b sampled (T=0.8, top_p=0.9, n=2): logprob |diff| max {d.max():.3e} mean {d.mean():.3e}")
    assert all(len(g.token_ids) == new for g in sampled)
    assert d.mean() < 0.05 and d.max() < 1.0


def test_megakernel_is_the_default_batch1_path_on_sm90():
    """`megakernel=None` (the default) runs batch 1 through the PDL megakernel on sm_90+ for a bf16 fused model,
    and stays off without a word for fp32 (unsupported) and for the unfused layers of the true on-policy mode.

    Nothing here may depend on what ran before: the models are built (and torch's modules imported, with their
    own import-time deprecation warnings) before the warnings filter, and `num_slots` is fixed: the default,
    None, sizes the KV cache from the GPU's free memory, which in a suite is whatever the earlier tests' models
    and the caching allocator left (the test failed in the GPU suite and passed alone)."""
    import warnings

    import torch._inductor.compile_fx  # noqa: F401 - torch's own import-time deprecation warnings, before the filter

    pdl = torch.cuda.get_device_capability()[0] >= 9
    models = {name: build_model("small", device="cuda", dtype=dtype)
              for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32), ("unfused", torch.bfloat16))}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # auto never warns
        bf16 = TorchEngine(models["bf16"], TorchEngineConfig(max_seq_len=64, num_slots=2))
        fp32 = TorchEngine(models["fp32"], TorchEngineConfig(max_seq_len=64, num_slots=2))
        unfused = TorchEngine(models["unfused"], TorchEngineConfig(max_seq_len=64, num_slots=2, fused_weights=False))
    assert (bf16.runner.megakernel is not None) == pdl
    assert not pdl or bf16.runner.megakernel.layers.stage_sync == "pdl"
    assert fp32.runner.megakernel is None and unfused.runner.megakernel is None


def test_warm_up_one_layer_graph_for_all_layers_and_buckets():
    """Every (batch, kv_len) bucket, b == num_slots and kv_len == max_seq_len included, shares one compile of
    (prologue, layer, head); a second mode adds only its head."""
    from torch._dynamo.utils import counters

    from rlbench.engine.torch_engine import KV_FLOOR, all_buckets

    model = build_model("small", device="cuda", dtype=torch.bfloat16)
    engine = TorchEngine(model, TorchEngineConfig(max_seq_len=1024, num_slots=16, compile=True, cuda_graphs=True,
                                                  gemv_batch1=False, megakernel=False))  # batch 1: other tests
    before = counters["stats"]["unique_graphs"]
    n = engine.warm_up()
    assert engine.runner.cuda_graphs and engine.runner.compiled, "compile/graph capture fell back (see warnings)"
    assert n == len(engine.runner._graphs) == len(all_buckets(16, 2)) * len(all_buckets(1024, KV_FLOOR))
    assert counters["stats"]["unique_graphs"] - before == 3, "a layer or bucket recompiled the decode step"
    greedy = engine.generate(_prompts([5, 300], model.config.vocab_size), SamplingParams(temperature=0.0,
                                                                                       max_new_tokens=8))
    assert all(len(g.token_ids) == 8 for g in greedy)
    assert counters["stats"]["unique_graphs"] - before == 4  # + the greedy head, once


@pytest.mark.parametrize("fused,attention,gemv", [(True, "split", False), (True, "sdpa", False),
                                                  (False, "split", False), (True, "split", True)])
def test_decode_variants_fp32_equal_eager(no_tf32, fused, attention, gemv):
    """fp32 (TF32 off): each compiled + captured variant == the eager, unfused engine (greedy tokens, log-probs)."""
    model = build_model("small", device="cuda", dtype=torch.float32)
    cfg = dict(max_seq_len=512, num_slots=4)
    engine = TorchEngine(model, TorchEngineConfig(**cfg, fused_weights=fused, decode_attention=attention,
                                                  gemv_batch1=gemv))
    ref = TorchEngine(build_model("small", device="cuda", dtype=torch.float32),
                      TorchEngineConfig(**cfg, compile=False, cuda_graphs=False, fused_weights=False))
    prompts = _prompts([5, 17, 300, 9, 60], model.config.vocab_size)
    for sampling in (SamplingParams(temperature=0.0, max_new_tokens=24),
                     SamplingParams(temperature=0.8, max_new_tokens=24, n=2, seed=3)):
        got, want = engine.generate(prompts, sampling), ref.generate(prompts, sampling)
        assert engine.runner.compiled and engine.runner.cuda_graphs and engine.runner.fused == fused
        assert [g.token_ids for g in got] == [g.token_ids for g in want]
        d = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g.log_probs, w.log_probs))
        print(f"\nfused={fused} {attention} gemv_batch1={gemv}: logprob |diff| max {d:.2e}")
        assert d < 1e-4
    one = engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=16))  # batch bucket 1 or 2
    assert one[0].token_ids == ref.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=16))[0].token_ids


def test_sampler_noise_and_tokens_on_cuda_equal_the_cpu():
    """The int32-lane hash gives the same noise on the GPU (eager and inductor) as on the CPU, so a sample's tokens
    do not depend on the device that drew them (the logits given)."""
    from rlbench.engine.sampling import sample_tokens, token_hash, uniform_noise

    B, V = 64, 151936
    seeds = torch.arange(B) * 2_654_435_761 + 2**31  # beyond int32: only the low 32 bits count
    steps = torch.arange(B) * 37
    want = uniform_noise(seeds, steps, token_hash(V))
    dev = (seeds.cuda(), steps.cuda(), token_hash(V, "cuda"))
    assert torch.equal(uniform_noise(*dev).cpu(), want)
    assert torch.equal(torch.compile(uniform_noise)(*dev).cpu(), want)
    logits = torch.randn(B, V, generator=torch.Generator().manual_seed(0)) * 3
    args = (torch.ones(B), torch.zeros(B, dtype=torch.long), torch.ones(B))
    tok, _ = sample_tokens(logits, *args, seeds, steps, token_hash(V), truncate=False)
    tok_cuda, _ = sample_tokens(logits.cuda(), *(a.cuda() for a in args), *dev, truncate=False)
    assert torch.equal(tok_cuda.cpu(), tok)
