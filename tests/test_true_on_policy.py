"""True on-policy mode on the CPU: the engine's log-probs equal the trainer's recompute BIT FOR BIT.

The engine decodes with continuous batching (3 slots for 6 prompts x 2 samples: sequences are admitted and
evicted mid-generation, samples share a prefilled prefix); the trainer side recomputes the same tokens
packed, padded and split into micro-batches. Every comparison is `torch.equal` (max |diff| == 0.0), and a
negative control shows the comparison can fail.
"""

from __future__ import annotations

import copy

import pytest
import torch

from rlbench import numerics
from rlbench.algorithms import token_logprobs
from rlbench.engine import SamplingParams, TorchEngine, TorchEngineConfig
from rlbench.models import build_model
from rlbench.numerics import torch_ops

LENGTHS = [3, 9, 17, 5, 12, 1]
TEMPERATURE = 0.7


def _prompts(seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in LENGTHS]


def _engine_and_trainer_model(dtype: torch.dtype, invariant: bool = True, **engine_kw):
    """An engine in the mode and the trainer's own copy of the same weights (batch-invariant too)."""
    model = _scaled_tiny(dtype)
    trainer_model = copy.deepcopy(model)
    cfg = TorchEngineConfig(**{"max_seq_len": 96, "num_slots": 3, "steps_per_sync": 4, "batch_invariant": invariant,
                               **engine_kw})
    engine = TorchEngine(model, cfg)
    if invariant:
        numerics.make_batch_invariant(trainer_model)
    return engine, trainer_model.eval()


def _scaled_tiny(dtype: torch.dtype):
    """The tiny Qwen3 with its matrices x4: logits far from uniform, so rounding differences show in log-probs."""
    model = build_model("tiny", seed=0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4)
    return model.to(dtype)


def _generate(engine, n: int = 2, max_new: int = 20, **kw):
    prompts = _prompts()
    params = SamplingParams(temperature=TEMPERATURE, max_new_tokens=max_new, n=n, seed=5, **kw)
    return prompts, engine.generate(prompts, params)


def _lse(invariant: bool):
    return numerics.logsumexp_rows if invariant else None


def packed_logprobs(model, seqs: list[tuple[list[int], list[int]]], invariant: bool = True) -> list[torch.Tensor]:
    """The trainer's recompute: one packed forward (positions restart per sequence), response log-probs each."""
    tokens = torch.tensor([t for p, r in seqs for t in p + r])
    positions = torch.cat([torch.arange(len(p) + len(r)) for p, r in seqs])
    with torch.no_grad():
        logits = model(input_ids=tokens[None], position_ids=positions[None], use_cache=False).logits[0]
    logp, _ = token_logprobs(logits, torch.roll(tokens, -1), TEMPERATURE, with_entropy=False,
                             lse_fn=_lse(invariant))
    out, start = [], 0
    for p, r in seqs:
        out.append(logp[start + len(p) - 1 : start + len(p) + len(r) - 1])
        start += len(p) + len(r)
    return out


def padded_logprobs(model, seqs: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
    """The same, as one right-padded batch `[B, L]` (pads after the real tokens)."""
    width = max(len(p) + len(r) for p, r in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, (p, r) in enumerate(seqs):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
    positions = torch.arange(width).expand(len(seqs), width)
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    out = []
    for i, (p, r) in enumerate(seqs):
        logp, _ = token_logprobs(logits[i], torch.roll(ids[i], -1), TEMPERATURE, with_entropy=False,
                                 lse_fn=numerics.logsumexp_rows)
        out.append(logp[len(p) - 1 : len(p) + len(r) - 1])
    return out


def _seqs(prompts, gens):
    return [(prompts[g.prompt_index], g.token_ids) for g in gens]


def _assert_bitwise(gens, recomputed):
    for g, lp in zip(gens, recomputed):
        rollout = torch.tensor(g.log_probs, dtype=torch.float32)
        assert torch.equal(rollout, lp.float()), f"sample {g.prompt_index}/{g.sample_index}: max |diff| " \
                                                 f"{(rollout - lp.float()).abs().max():.3e}"


@pytest.mark.parametrize("shared_prefix", [True, False], ids=["grouped", "slots"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_logprobs_equal_packed_padded_and_split_recompute(dtype, shared_prefix):
    """Continuous batching (admit/evict mid-generation), n=2 sharing a prefix (one copy of the prompt's K/V in the
    grouped layout, or a copy per sample); packed, padded, micro-batches."""
    engine, trainer = _engine_and_trainer_model(dtype, num_slots=4, shared_prefix=shared_prefix)
    prompts, gens = _generate(engine)
    seqs = _seqs(prompts, gens)
    assert len(gens) == 12 and sum(len(g.token_ids) for g in gens) == 240
    _assert_bitwise(gens, packed_logprobs(trainer, seqs))
    _assert_bitwise(gens, padded_logprobs(trainer, seqs))
    split = packed_logprobs(trainer, seqs[:5]) + packed_logprobs(trainer, seqs[5:9]) + packed_logprobs(trainer, seqs[9:])
    _assert_bitwise(gens, split)
    alone = [lp for s in seqs for lp in packed_logprobs(trainer, [s])]
    _assert_bitwise(gens, alone)


@pytest.mark.parametrize("fused", ["fused", "hf-layers", "columns-differ"])
def test_stop_tokens_top_p_and_many_slots_still_bitwise(monkeypatch, fused):
    """Samples that stop at different lengths (stop token), top-p sampling, and a batch of 8 slots; the engine's
    fused QKV / gate-up forward over the batch-invariant ops, the HF layers (`fused_weights=False`), and the HF
    layers chosen because stacked weights would not give the separate GEMMs' columns on this machine."""
    if fused == "columns-differ":
        monkeypatch.setattr(numerics, "columns_invariant", lambda device, dtype: False)
    engine, trainer = _engine_and_trainer_model(torch.float32, num_slots=8, fused_weights=fused != "hf-layers")
    assert engine.runner.fused == (fused == "fused")
    prompts, gens = _generate(engine, n=3, max_new=24, top_p=0.9, stop_token_ids=[7, 11])
    assert len({len(g.token_ids) for g in gens}) > 1  # some stopped early
    _assert_bitwise(gens, packed_logprobs(trainer, _seqs(prompts, gens)))


def test_without_the_mode_logprobs_differ():
    """Negative control: default kernels (fused engine, SDPA trainer) do not give bitwise-equal log-probs."""
    engine, trainer = _engine_and_trainer_model(torch.float32, invariant=False)
    prompts, gens = _generate(engine)
    recomputed = packed_logprobs(trainer, _seqs(prompts, gens), invariant=False)
    diffs = torch.cat([torch.tensor(g.log_probs) - lp for g, lp in zip(gens, recomputed)]).abs()
    assert (diffs > 0).sum() > 0.05 * diffs.numel()
    assert diffs.max() < 1e-4  # the same model, only rounding apart


def test_batch_invariant_forward_matches_default_and_grads_agree():
    """The mode computes the same function: logits within fp32 rounding of SDPA, gradients of a packed loss too."""
    base = _scaled_tiny(torch.float32).train()
    inv = numerics.make_batch_invariant(copy.deepcopy(base))
    tokens = torch.randint(0, 128, (1, 40))
    positions = torch.cat([torch.arange(15), torch.arange(25)])[None]
    losses = []
    for model in (base, inv):
        logits = model(input_ids=tokens, position_ids=positions, use_cache=False).logits[0]
        logp, ent = token_logprobs(logits, torch.roll(tokens[0], -1), 1.0, with_entropy=True)
        loss = -(logp.sum() + 0.1 * ent.sum())
        loss.backward()
        losses.append(loss.detach())
    assert torch.allclose(losses[0], losses[1], rtol=1e-5)
    for (name, a), b in zip(base.named_parameters(), inv.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-3, atol=1e-5), name


def test_self_test_names_the_op_that_is_not_invariant(monkeypatch):
    """A GEMM whose rows depend on the batch size fails the start-up self-test with the op's name."""
    from rlbench.numerics import check

    real = torch_ops.matmul
    def varies(x, w, b=None, out=None):  # rows change with the row count
        return out.copy_(real(x, w, b) * (1 + 1e-6 * (x.shape[0] > 1)))

    monkeypatch.setattr(torch_ops, "matmul", varies)
    monkeypatch.setattr(check, "_passed", set())
    with pytest.raises(RuntimeError, match="batch-invariant linear is not bitwise invariant"):
        numerics.self_test("cpu", torch.float32)


def test_compiled_self_test_names_a_head_that_rounds_unlike_eager(monkeypatch):
    """The compiled engine head's log-probs must be the trainer's bits: a logsumexp that inductor traces and
    compiles (instead of the opaque batch-invariant op) rounds otherwise, and the compiled self-test names it."""
    from rlbench.numerics import check, ops

    monkeypatch.setattr(ops, "logsumexp_rows", lambda z: torch_ops.logsumexp_rows(z.contiguous()))
    monkeypatch.setattr(check, "_passed", set())
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="compiled sampling head"):
        numerics.self_test("cpu", torch.bfloat16, compiled=True)
    torch._dynamo.reset()


def test_attention_layout_rejects_sequences_not_starting_at_zero():
    model = numerics.make_batch_invariant(_scaled_tiny(torch.float32))
    with pytest.raises(ValueError, match="start at position 0"):
        model(input_ids=torch.zeros(1, 6, dtype=torch.long), position_ids=torch.tensor([[3, 4, 5, 0, 1, 2]]))


def _char_reward(response: str, label) -> float:
    """A reward that differs between samples of a group (so advantages, gradients and weights are not zero)."""
    return (sum(map(ord, response)) % 7) / 6


@pytest.mark.parametrize("bypass, compiled", [(False, False), (True, False), (False, True)],
                         ids=["recompute", "rollout-logprobs", "compiled-trainer"])
def test_trainer_steps_log_exactly_zero_mismatch(tmp_path, monkeypatch, bypass, compiled):
    """`Trainer.step()` in the mode: the diff is 0.0 at every step (the engine follows every weight sync), and
    the very first micro-batch's training forward equals the engine's log-probs (`first_mb_kl_vs_rollout` 0.0),
    with old = the rollout's log-probs (no recompute) too. With the trainer's layers compiled by inductor
    (`numerics.compile_options`) against the eager engine too. Both metrics do move when the engine differs
    (`test_a_perturbed_engine_shows_in_both_metrics`)."""
    from dataclasses import replace

    from rlbench import Trainer, presets
    from rlbench.configs import EvalConfig
    from rlbench.rewards import REWARDS

    monkeypatch.setitem(REWARDS, "chars", _char_reward)
    cfg = presets.cpu_test(model="tiny", workdir=str(tmp_path), level=1, n_eval=16)
    cfg = cfg.replace(
        true_on_policy_mode=True, eval=EvalConfig(), data=replace(cfg.data, metadata_key=None),
        rollout=replace(cfg.rollout, rm_type="chars", rollout_batch_size=4, max_response_len=10),
        batch=replace(cfg.batch, global_batch_size=16, num_rollout=3),
        loss=replace(cfg.loss, use_rollout_logprobs=bypass), backend=replace(cfg.backend, fsdp=replace(cfg.backend.fsdp, compile=compiled)))
    trainer = Trainer(cfg)
    weights = [p.detach().clone() for p in trainer.engine.model.parameters()][:3]
    for _ in range(3):
        m = trainer.step()
        assert m["train/first_mb_kl_vs_rollout"] == 0.0
        if not bypass:
            assert m["train/train_rollout_logprob_abs_diff"] == 0.0 and m["train/mismatch_k3_kl"] == 0.0
    assert m["train/grad_norm"] > 0
    assert any(not torch.equal(w, p) for w, p in zip(weights, trainer.engine.model.parameters()))


def test_a_perturbed_engine_shows_in_both_metrics(tmp_path, monkeypatch):
    """The mode's evidence can fail: an engine whose weights differ from the trainer's by one float32 ulp in one
    matrix (nudged after every sync) gives a nonzero diff and a nonzero first-micro-batch gap."""
    from dataclasses import replace

    from rlbench import Trainer, presets
    from rlbench.configs import EvalConfig
    from rlbench.rewards import REWARDS

    monkeypatch.setitem(REWARDS, "chars", _char_reward)
    cfg = presets.cpu_test(model="tiny", workdir=str(tmp_path), level=1, n_eval=16)
    cfg = cfg.replace(
        true_on_policy_mode=True, eval=EvalConfig(), data=replace(cfg.data, metadata_key=None),
        rollout=replace(cfg.rollout, rm_type="chars", rollout_batch_size=4, max_response_len=10),
        batch=replace(cfg.batch, global_batch_size=16, num_rollout=1))
    trainer = Trainer(cfg)
    engine, update = trainer.engine, trainer.engine.update_weights

    def nudged(buckets, version):
        update(buckets, version)
        w = dict(engine.model.named_parameters())["model.layers.0.mlp.down_proj.weight"]
        with torch.no_grad():
            w.copy_(torch.nextafter(w, torch.full_like(w, float("inf"))))

    monkeypatch.setattr(engine, "update_weights", nudged)
    trainer.sync_weights()
    m = trainer.step()
    assert m["train/train_rollout_logprob_abs_diff"] > 0 and m["train/first_mb_kl_vs_rollout"] > 0


@pytest.mark.parametrize("step_rows", [512, 5], ids=["one-block", "blocks-of-5"])
@pytest.mark.parametrize("rows", [1, 2], ids=["packed", "rows"])
def test_attention_gradients_match_float64_sdpa(monkeypatch, rows, step_rows):
    """The mode's attention backward (written out per sequence, in blocks of query rows) against autograd through
    SDPA in float64: GQA, several sequences per row, a one-token sequence."""
    from rlbench.numerics import layout, ops

    monkeypatch.setattr(ops, "MATH_BACKWARD_ROWS", step_rows)

    n_kv, group, hd = 2, 2, 16
    lengths = [[9, 1, 14], [17, 7]][:rows]
    position_ids = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in lengths])
    t = position_ids.shape[1]
    tiles = layout.document_tiles(position_ids, ops.tokens_per_tile(torch.device("cpu"), group))
    gen = torch.Generator().manual_seed(rows)
    q, k, v = (torch.randn(rows, t, c, hd, generator=gen, dtype=torch.float64) for c in (n_kv * group, n_kv, n_kv))
    grad = torch.randn(rows, t, n_kv * group, hd, generator=gen, dtype=torch.float64)

    def reference(q, k, v):
        bounds = tiles.cu_seqlens.tolist()
        flat = [x.reshape(rows * t, -1, hd) for x in (q, k, v)]
        outs = [torch.nn.functional.scaled_dot_product_attention(
            *(x[s:e].transpose(0, 1)[None] for x in flat), is_causal=True, scale=0.3, enable_gqa=True)[0].transpose(0, 1)
            for s, e in zip(bounds[:-1], bounds[1:])]
        return torch.cat(outs).view(rows, t, -1, hd)

    got, want = [], []
    for fn, out in ((lambda *x: ops.attention(*x, tiles, 0.3), got), (reference, want)):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        torch.autograd.backward(fn(*leaves), grad)
        out += [x.grad for x in leaves]
    for name, g, w in zip("qkv", got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"d{name}: {m}")


def test_batch_invariant_custom_ops_pass_opcheck():
    """The `rlbench_bi` custom ops: schema, fake (meta) layouts equal to the real outputs', autograd registration
    (`torch.library.opcheck`), on strided inputs like the ones a fused QKV slice or a transposed query gives."""
    from rlbench.numerics import layout, ops

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 48, generator=gen)[..., :32].requires_grad_()  # strided rows
    w, b = torch.randn(24, 32, generator=gen).requires_grad_(), torch.randn(24, generator=gen).requires_grad_()
    torch.library.opcheck(torch.ops.rlbench_bi.linear, (x, w, b))
    torch.library.opcheck(torch.ops.rlbench_bi.linear, (x, w, None))
    torch.library.opcheck(torch.ops.rlbench_bi.rms_norm, (x, torch.randn(32, generator=gen).requires_grad_(), 1e-6))
    torch.library.opcheck(torch.ops.rlbench_bi.silu, (x,))
    torch.library.opcheck(torch.ops.rlbench_bi.logsumexp_rows, (torch.randn(3, 700, generator=gen),))
    positions = torch.cat([torch.arange(4), torch.arange(6)])[None]
    tiles = layout.document_tiles(positions, ops.tokens_per_tile(torch.device("cpu"), 2))
    q = torch.randn(1, 4, 10, 16, generator=gen).transpose(1, 2).requires_grad_()  # [1, T, H, hd], permuted
    k, v = (torch.randn(1, 10, 2, 16, generator=gen).requires_grad_() for _ in range(2))
    args = (q, k, v, tiles.positions, tiles.tok0, tiles.ntok, tiles.kb, tiles.kstart, None, None, tiles.cu_seqlens, 1,
            0.25)
    torch.library.opcheck(torch.ops.rlbench_bi.attention, args)
    grad = torch.randn(1, 10, 4, 16, generator=gen)
    torch.library.opcheck(torch.ops.rlbench_bi.attention_backward, (grad, q.detach(), k.detach(), v.detach(),
                                                                     tiles.cu_seqlens, 0.25))


def test_compiled_engine_equals_the_trainer_bitwise():
    """The engine's decode step compiled by inductor (as on CUDA, here on the CPU): the fused batch-invariant layer
    with the grouped layout and the sampling head, `numerics.compile_options`; one layer graph and one head graph, no
    fallback to eager, the trainer's bits."""
    import dataclasses

    from torch._dynamo.utils import counters

    from rlbench.engine.runner import ModelRunner

    engine, trainer = _engine_and_trainer_model(torch.bfloat16, num_slots=4)
    engine.runner = ModelRunner(engine.model, engine.cache, dataclasses.replace(engine.cfg.on_device(False), compile=True))
    assert engine.runner.fused and engine.runner.compiled
    graphs = counters["stats"]["unique_graphs"]
    prompts, gens = _generate(engine)
    assert engine.runner.compiled  # a failed compile falls back to eager (and says so): it did not
    assert counters["stats"]["unique_graphs"] - graphs == 2  # layer and head: one each for every layer, batch, kv_len
    _assert_bitwise(gens, packed_logprobs(trainer, _seqs(prompts, gens)))
