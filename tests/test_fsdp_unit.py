"""Single-process pieces of the FSDP backend: packed-sequence isolation per attention backend, LR
schedules, config validation, the host stash behind sleep/wake_up, and optimizer-state init."""

from __future__ import annotations

import dataclasses as dc
import math

import pytest
import torch

from rlbench.algorithms.logprobs import token_logprobs
from rlbench.backends.attention import document_block_mask, document_ids
from rlbench.backends.offload import HostStash
from rlbench.backends.optim import build_optimizer, init_optimizer_state, lr_at
from rlbench.configs.backend import FSDPOptions, OptimConfig, TrainConfig
from rlbench.models import build_model
from rlbench.packing.pack import pack_samples
from rlbench.types import Sample

SAMPLES = [
    Sample(tokens=[5, 17, 3, 99, 42, 7, 8], response_length=4),
    Sample(tokens=[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], response_length=6),
    Sample(tokens=[64, 65, 66, 67, 68], response_length=2),
]


def _response_logp(model, tokens, positions, index) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=tokens[None], position_ids=positions[None], use_cache=False).logits[0]
    logp, _ = token_logprobs(logits.double(), torch.roll(tokens, -1), with_entropy=False)
    return logp[index]


def _packed_vs_alone(model) -> tuple[float, float]:
    """(max |packed - alone| over response log-probs, same with position ids that do not restart)."""
    pack = pack_samples(SAMPLES, pad_multiple=8)
    packed = torch.split(_response_logp(model, pack.tokens, pack.position_ids, pack.response_index), pack.response_lengths)
    alone = []
    for s in SAMPLES:
        p = pack_samples([s])
        alone.append(_response_logp(model, p.tokens, p.position_ids, p.response_index))
    diff = max(float((a - b).abs().max()) for a, b in zip(packed, alone))
    leaky_pos = torch.arange(pack.num_tokens)  # one long document: sequences see each other
    leaky = torch.split(_response_logp(model, pack.tokens, leaky_pos, pack.response_index), pack.response_lengths)
    return diff, max(float((a - b).abs().max()) for a, b in zip(leaky, alone))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_equals_per_sequence(attn):
    model = build_model("tiny", seed=1, attn_implementation=attn).eval()
    diff, leaky = _packed_vs_alone(model)
    print(f"{attn}: packed vs per-sequence fp32 max|diff logp| = {diff:.3g} (no restart: {leaky:.3g})")
    assert diff <= 1e-5
    assert leaky > 1e-3  # the check can fail: without restarting positions, sequences leak into each other


def test_document_ids():
    pos = torch.tensor([0, 1, 2, 0, 1, 0, 1, 2, 3, 0])
    assert document_ids(pos).tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2, 3]


def test_lr_schedules():
    cos = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=4, warmup_init_lr=0.2, lr_schedule="cosine", decay_steps=10)
    assert [lr_at(s, cos) for s in (0, 2, 4)] == pytest.approx([0.2, 0.6, 1.0])
    assert lr_at(9, cos) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(14, cos) == pytest.approx(0.1) and lr_at(100, cos) == pytest.approx(0.1)
    lin = OptimConfig(lr=1.0, min_lr=0.0, lr_schedule="linear", decay_steps=4)
    assert [lr_at(s, lin) for s in range(6)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0, 0.0])
    assert lr_at(1000, OptimConfig(lr=3e-6)) == 3e-6


@pytest.mark.parametrize(
    "kwargs",
    [dict(lr_schedule="cosine"), dict(lr_schedule="step"), dict(lr=1e-6, min_lr=1e-5), dict(clip_grad=-1.0)],
)
def test_optim_config_validation(kwargs):
    with pytest.raises(ValueError):
        OptimConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(device="tpu"),
        dict(param_dtype="fp8"),
        dict(attn_implementation="flash"),
        dict(checkpoint_format="zip"),
        dict(device="cpu", attn_implementation="flex_attention"),  # wrong packed logits on CPU in torch 2.13
        dict(device="cpu", attn_implementation="flash_attention_2"),
        dict(device="cuda", attn_implementation="kernels-community/flash-attn"),
        dict(ref_model="tiny", ref_update_interval=0),
    ],
)
def test_fsdp_config_validation(kwargs):
    own = {f.name for f in dc.fields(FSDPOptions)}
    top = {k: v for k, v in kwargs.items() if k not in own}
    fsdp = {k: v for k, v in kwargs.items() if k in own}
    with pytest.raises(ValueError, match=str(list(kwargs.values())[-1])):
        TrainConfig(**top, fsdp=FSDPOptions(**fsdp))


def test_hub_kernels_refused_with_a_clear_message():
    with pytest.raises(ValueError, match="Hub kernels .* not supported.*flash_attention_2"):
        TrainConfig(device="cuda", fsdp=FSDPOptions(attn_implementation="kernels-community/vllm-flash-attn3"))
    assert TrainConfig(device="cuda", fsdp=FSDPOptions(attn_implementation="flash_attention_2")).attention == "flash_attention_2"


def test_ref_update_config_and_schedule():
    from rlbench.trainer import ref_update_due

    with pytest.raises(ValueError, match="needs a reference model; set ref_model"):
        TrainConfig(ref_update_interval=2)

    assert [r for r in range(10) if ref_update_due(3, r)] == [2, 5, 8]  # after every 3rd completed rollout
    assert [r for r in range(3) if ref_update_due(1, r)] == [0, 1, 2]
    assert not any(ref_update_due(None, r) for r in range(10))


def test_host_stash_round_trip_frees_and_restores_shared_storages():
    base = torch.randn(1000, dtype=torch.float64)
    view = base[10:20]  # shares base's storage: stashed once
    other = torch.randint(0, 9, (33,), dtype=torch.int32)
    want = (base.clone(), other.clone())
    stash = HostStash()
    moved = stash.offload([base, view, other], torch.device("cpu"))
    assert moved == base.numel() * 8 + other.numel() * 4
    assert base.untyped_storage().nbytes() == 0 and other.untyped_storage().nbytes() == 0
    assert stash.restore() == moved
    assert torch.equal(base, want[0]) and torch.equal(other, want[1]) and torch.equal(view, want[0][10:20])


def test_init_optimizer_state_is_a_fresh_optimizer():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    b.load_state_dict(a.state_dict())
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1)
    oa, ob = build_optimizer(a.parameters(), cfg, fused=False), build_optimizer(b.parameters(), cfg, fused=False)
    init_optimizer_state(ob)
    assert all(float(s["step"]) == 0 for s in ob.state.values())
    x = torch.randn(5, 4)
    for model, opt in ((a, oa), (b, ob)):
        model(x).square().sum().backward()
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("lengths", [[300], [128, 128, 44], [100, 29, 400, 3], [1, 1, 1, 500], [700, 20, 128]])
def test_document_block_mask_equals_create_block_mask(lengths):
    from torch.nn.attention.flex_attention import create_block_mask

    pos = torch.cat([torch.arange(n) for n in lengths])
    docs = document_ids(pos)
    T = docs.numel()
    got = document_block_mask(pos)
    want = create_block_mask(lambda b, h, q, kv: (docs[q] == docs[kv]) & (kv <= q), 1, None, T, T, device="cpu")
    assert got.shape == want.shape and torch.equal(got.to_dense(), want.to_dense())
    for num, idx in [("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices"), ("q_num_blocks", "q_indices")]:
        assert torch.equal(getattr(got, num), getattr(want, num)), num
        for row, k in enumerate(getattr(got, num)[0, 0].tolist()):
            assert torch.equal(getattr(got, idx)[0, 0, row, :k], getattr(want, idx)[0, 0, row, :k]), (idx, row)
    assert int(got.full_kv_num_blocks.sum()) > 0 or max(lengths) < 256  # full blocks exist and are exercised


def _compiled_graphs(layers: int, compile: bool) -> tuple[int, list[torch.Tensor], dict]:
    """(dynamo graphs compiled, [log-prob pass before, after one train step, the training forward], train
    metrics) for a fresh backend."""
    from torch._dynamo.utils import counters

    from rlbench.backends.fsdp.actor import FSDPBackend

    torch._dynamo.reset()
    counters.clear()
    cfg = TrainConfig(model="tiny", device="cpu", param_dtype="fp32", model_overrides={"num_hidden_layers": layers}, optim=OptimConfig(lr=1e-3), fsdp=FSDPOptions(gradient_checkpointing=True, compile=compile))
    seen = []

    def loss_fn(logp, ent, inputs):
        seen.append(logp.detach())
        return -logp.sum(), {}

    backend = FSDPBackend(cfg, loss_fn=loss_fn)
    backend.init()
    pack = pack_samples(SAMPLES, pad_multiple=8)
    before = backend.compute_log_prob([pack])[0].log_probs
    metrics = backend.train([pack], [None])
    after = backend.compute_log_prob([pack])[0].log_probs
    return int(counters["stats"]["unique_graphs"]), [before, after, seen[0]], metrics


def test_compiled_layers_compile_once_regardless_of_depth(monkeypatch):
    """Each decoder layer is compiled once per T, shared by all layers: 2 and 6 layers give one dynamo graph (the
    log-prob pass runs the checkpointed training forward's graph, so it returns the training forward's bits),
    and compiled (inductor) == eager. The 6-layer count uses the aot_eager backend: the graph count is
    dynamo's, the same for every backend."""
    import torch.distributed as dist

    from rlbench.backends.fsdp import model as fsdp_model

    torch.set_num_threads(1)
    try:
        graphs2, logps, metrics = _compiled_graphs(2, compile=True)
        monkeypatch.setitem(fsdp_model._COMPILE_OPTIONS, "backend", "aot_eager")
        graphs6, _, _ = _compiled_graphs(6, compile=True)
        _, eager_logps, eager_metrics = _compiled_graphs(2, compile=False)
    finally:
        torch._dynamo.reset()
        if dist.is_initialized():
            dist.destroy_process_group()
    print(f"dynamo graphs: 2 layers {graphs2}, 6 layers {graphs6}")
    assert graphs2 == graphs6 == 1
    assert torch.equal(logps[0], logps[2])  # compiled log-prob pass == compiled training forward, bit for bit
    for got, want in zip(logps, eager_logps):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert metrics["train/loss"] == pytest.approx(eager_metrics["train/loss"], rel=1e-5)
    assert metrics["train/grad_norm"] == pytest.approx(eager_metrics["train/grad_norm"], rel=1e-4)
    assert not torch.equal(logps[0], logps[1])  # the step changed the weights: the second pass is a real check


def test_trainer_copies_actor_into_ref_every_n_rollouts(tmp_path):
    """ref_update_interval=2 through the Trainer: after rollout 0 the trained actor and the ref differ, after
    rollout 1 (the 2nd completed) the ref holds the actor's weights: equal log-probs, bit for bit."""
    import dataclasses as dc

    import torch.distributed as dist

    from rlbench import Trainer, presets

    cfg = presets.cpu_test(model="tiny", workdir=str(tmp_path), level=1, n_eval=16)
    cfg = cfg.replace(
        rollout=dc.replace(cfg.rollout, rollout_batch_size=4, n_samples_per_prompt=4, max_response_len=8),
        batch=dc.replace(cfg.batch, global_batch_size=8, max_tokens_per_gpu=128),
        eval=dc.replace(cfg.eval, interval=None),
        backend=dc.replace(cfg.backend, ref_model="tiny", ref_update_interval=2),
        loss=dc.replace(cfg.loss, use_kl_loss=True, kl_loss_coef=0.01),
    )
    trainer = Trainer(cfg)
    try:
        for rollout, updated in ((0, False), (1, True)):
            metrics = trainer.step()
            packs = trainer.last_rollout.packs[0]
            actor = [o.log_probs for o in trainer.backend.compute_log_prob(packs)]
            ref = [o.log_probs for o in trainer.backend.compute_log_prob(packs, model="ref")]
            assert ("perf/ref_update_time" in metrics) == updated, rollout
            assert all(torch.equal(a, r) for a, r in zip(actor, ref)) == updated, rollout
    finally:
        trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def test_log_probs_use_the_sampling_temperature(tmp_path):
    """One temperature: `build_backend` hands `rollout.temperature` to the backend, whose log-probs are those of
    softmax(logits / T)."""
    import dataclasses as dc

    import torch.distributed as dist

    from rlbench import presets
    from rlbench.orchestration.local import build_backend

    cfg = presets.cpu_test(model="tiny", workdir=str(tmp_path))
    cfg = cfg.replace(rollout=dc.replace(cfg.rollout, temperature=0.7))
    torch.set_num_threads(1)
    try:
        backend = build_backend(cfg)
        pack = pack_samples(SAMPLES, pad_multiple=8)
        got = backend.compute_log_prob([pack])[0].log_probs  # [R]
        with torch.no_grad():
            logits = backend.model(input_ids=pack.tokens[None], position_ids=pack.position_ids[None], use_cache=False).logits[0]
        want = {t: token_logprobs(logits.double(), torch.roll(pack.tokens, -1), t, with_entropy=False)[0][pack.response_index]
                for t in (0.7, 1.0)}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert backend.temperature == 0.7
    torch.testing.assert_close(got.double(), want[0.7], rtol=1e-5, atol=1e-5)
    assert (got.double() - want[1.0]).abs().max() > 1e-3


def test_attention_and_compile_defaults_follow_the_device():
    """No performance flag: flex_attention + compiled layers on CUDA, sdpa eager on CPU; explicit values win;
    the batch-invariant layers compile too (with eager's rounding), CP runs uncompiled; a replaced device
    re-resolves (nothing is frozen)."""
    import dataclasses as dc

    cuda = TrainConfig(device="cuda")
    assert (cuda.attention, cuda.compiled) == ("flex_attention", True)
    cpu = dc.replace(cuda, device="cpu")
    assert (cpu.attention, cpu.compiled) == ("sdpa", False)
    assert TrainConfig(device="cuda", batch_invariant=True).compiled is True
    assert TrainConfig(device="cuda", cp_size=2).compiled is False
    explicit = TrainConfig(device="cuda", fsdp=FSDPOptions(attn_implementation="sdpa", compile=False))
    assert (explicit.attention, explicit.compiled) == ("sdpa", False)
    with pytest.raises(ValueError, match="needs device='cuda'"):
        TrainConfig(device="cpu", fsdp=FSDPOptions(attn_implementation="flex_attention"))


def test_bucketed_pack_lengths_bound_the_compiled_graphs(monkeypatch):
    """Compiled layers through RankStep over rollouts of many response lengths: the backend asks for bucketed
    packs (`pack_buckets`), so the old-log-prob, ref and training passes together compile exactly one graph per
    bucket length (at most 4 under a 512-token budget: 128..512), reported as `perf/compiles`, while the packs'
    unpadded lengths are all different (one graph each before). Padding does not change results: with the
    batch-invariant ops (GEMMs in fixed row chunks) the log-probs of a bucketed pack equal the unbucketed pack's
    bit for bit, and with the default ops to fp32 rounding (BLAS blocks a GEMM by its row count: 9.5e-7 seen)."""
    import dataclasses
    import random

    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from rlbench.algorithms import LossConfig
    from rlbench.backends.fsdp import model as fsdp_model
    from rlbench.backends.fsdp.actor import FSDPBackend
    from rlbench.configs import BatchConfig
    from rlbench.packing.pack import make_step_packs
    from rlbench.rank_step import RankStep

    torch.set_num_threads(1)
    monkeypatch.setitem(fsdp_model._COMPILE_OPTIONS, "backend", "aot_eager")  # dynamo's graph count, any backend
    rng = random.Random(0)

    def rollout() -> list[list[Sample]]:  # 2 optimizer steps of 6 samples, 40..100 tokens each
        samples = []
        for _ in range(12):
            prompt, resp = rng.randint(8, 40), rng.randint(1, 60)
            samples.append(Sample(tokens=[rng.randint(1, 127) for _ in range(prompt + resp)], response_length=resp,
                                  advantage=rng.uniform(-1, 1)))
        return [samples[:6], samples[6:]]

    torch._dynamo.reset()
    counters.clear()
    try:
        cfg = TrainConfig(model="tiny", ref_model="tiny", device="cpu", param_dtype="fp32", optim=OptimConfig(lr=1e-3), fsdp=FSDPOptions(compile=True))
        backend = FSDPBackend(cfg)
        backend.init()
        batch = BatchConfig(global_batch_size=6, use_dynamic_batch_size=True, max_tokens_per_gpu=512)
        step = RankStep(batch, LossConfig(use_kl_loss=True, kl_loss_coef=0.01), backend)
        lengths, unpadded, compiles = set(), set(), []
        for _ in range(6):
            packs = step.pack(rollout())
            old, ref, metrics = step.compute_log_probs(packs, first_from_forward=True)
            metrics |= step.train(packs, old, ref)
            compiles.append(metrics["perf/compiles"])
            lengths |= {p.num_tokens for mbs in packs for p in mbs}
            unpadded |= {int(p.cu_seqlens[-1]) for mbs in packs for p in mbs}
        graphs = int(counters["stats"]["unique_graphs"])

        samples = rollout()[0]
        plain, bucketed = (make_step_packs(samples, 1, 512, bucket=b)[0] for b in (False, True))
        results = []
        for attn, invariant in (("eager", False), (None, True)):
            eager = FSDPBackend(dataclasses.replace(cfg, ref_model=None, batch_invariant=invariant,
                                                    fsdp=FSDPOptions(attn_implementation=attn, compile=False)))
            eager.init()
            results.append([eager.compute_log_prob([p])[0].log_probs for p in (bucketed, plain)])
        (got, want), (got_bi, want_bi) = results
    finally:
        torch._dynamo.reset()
        if dist.is_initialized():
            dist.destroy_process_group()
    print(f"pack lengths {sorted(lengths)} (unpadded: {len(unpadded)} distinct), graphs {graphs}, "
          f"perf/compiles per rollout {compiles}")
    assert lengths <= {128, 256, 384, 512} and graphs == len(lengths)
    assert sum(compiles) == graphs
    assert len(unpadded) > 2 * len(lengths)  # without buckets, every one of these lengths was a new graph
    assert bucketed.num_tokens > plain.num_tokens and torch.equal(got_bi, want_bi)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_the_head_runs_on_response_rows_only_and_a_model_ignoring_logits_to_keep_is_named():
    """`forward_pack` asks the model for the logits of the positions predicting response tokens only
    (`logits_to_keep`): their log-probs equal the full-head computation's to fp32 rounding, and a model that
    returns every row instead is refused with its class name, not a shape error deep in the log-prob kernel."""
    from types import SimpleNamespace

    from rlbench.backends.fsdp.actor import FSDPBackend

    pack = pack_samples(SAMPLES, pad_multiple=8)
    backend = FSDPBackend(TrainConfig(model="tiny", device="cpu", param_dtype="fp32", fsdp=FSDPOptions(compile=False, attn_implementation="eager")))
    backend.init()
    try:
        with torch.no_grad():
            got, _ = backend.forward_pack(backend.model, pack, with_entropy=False)
            full = backend.model(input_ids=pack.tokens[None], position_ids=pack.position_ids[None],
                                 use_cache=False).logits[0]  # [T, V]
        want, _ = token_logprobs(full[pack.response_index], pack.tokens[pack.response_index + 1])
        assert got.shape == (int(pack.response_index.numel()),)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)

        class EveryRow(torch.nn.Module):
            def forward(self, input_ids, **kwargs):
                return SimpleNamespace(logits=torch.zeros(1, input_ids.shape[1], 11))

        with pytest.raises(TypeError, match="EveryRow returned .* logit rows for .* logits_to_keep"):
            backend.forward_pack(EveryRow(), pack, with_entropy=False)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
