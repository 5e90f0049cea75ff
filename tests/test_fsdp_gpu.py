"""FSDP backend on one CUDA device (world of one): flex_attention packing, sleep/wake_up memory, ref KL, ref update,
the log-prob passes == the training forward.

Run on the GPU machine: `pytest -m gpu tests/test_fsdp_gpu.py -q -s`.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

from rlbench.algorithms.logprobs import token_logprobs  # noqa: E402
from rlbench.backends.attention import document_block_mask  # noqa: E402
from rlbench.packing.pack import pack_samples  # noqa: E402
from rlbench.types import Sample  # noqa: E402


def _samples(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(40, 300, (1,), generator=g))
        out.append(Sample(tokens=torch.randint(0, 128, (length,), generator=g).tolist(), response_length=length // 2))
    return out


def _loss(logp, ent, inputs):
    return -(inputs["w"] * logp).sum(), {}


@pytest.fixture(scope="module")
def env():
    from rlbench.distributed.mesh import init_distributed

    return init_distributed("cuda")


def _backend(env, **kw):
    from rlbench.backends.fsdp.actor import FSDPBackend
    from rlbench.configs.backend import FSDPOptions, OptimConfig, TrainConfig

    fsdp = {k: kw.pop(k) for k in ("attn_implementation", "compile", "gradient_checkpointing") if k in kw}
    cfg = TrainConfig(model="small", device="cuda", optim=OptimConfig(lr=1e-4), fsdp=FSDPOptions(**fsdp), **kw)
    b = FSDPBackend(cfg, env=env, loss_fn=_loss)
    b.init()
    return b


def test_flex_document_mask_packed_equals_per_sequence():
    from rlbench.models import build_model

    model = build_model("small", device="cuda", attn_implementation="flex_attention", seed=3).eval()
    samples = _samples()
    pack = pack_samples(samples, pad_multiple=128)

    def logp(p):
        tokens, pos = p.tokens.cuda(), p.position_ids.cuda()
        with torch.no_grad():
            logits = model(input_ids=tokens[None], position_ids=pos[None], attention_mask=document_block_mask(pos), use_cache=False).logits[0]
        return token_logprobs(logits, torch.roll(tokens, -1), with_entropy=False)[0][p.response_index.cuda()]

    packed = torch.split(logp(pack), pack.response_lengths)
    alone = [logp(pack_samples([s])) for s in samples]
    diff = max(float((a - b).abs().max()) for a, b in zip(packed, alone))
    print(f"flex packed vs per-sequence fp32 max|diff| = {diff:.3g}")
    assert diff <= 1e-4


@pytest.mark.parametrize("attn", ["sdpa", "flex_attention"])
def test_train_step_finite_and_ref_kl_zero_bf16(env, attn):
    b = _backend(env, attn_implementation=attn, ref_model="small", gradient_checkpointing=True)
    pack = pack_samples(_samples(), pad_multiple=128)
    actor = b.compute_log_prob([pack])[0].log_probs
    ref = b.compute_log_prob([pack], model="ref")[0].log_probs  # CPU-offloaded params, same bf16 path
    assert torch.equal(actor, ref)
    w = torch.full_like(actor, 1.0 / actor.numel())
    m = b.train([pack], [{"w": w}])
    assert m["train/skipped"] == 0.0 and m["train/grad_norm"] > 0


def test_sleep_frees_and_wake_up_restores_exactly(env):
    b = _backend(env)
    pack = pack_samples(_samples(), pad_multiple=128)
    w = torch.full((pack.response_index.numel(),), 1e-3)
    b.train([pack], [{"w": w}])
    b.compute_log_prob([pack])  # forward only: the root must not stay gathered through sleep
    before = [p.to_local().clone() for p in b.model.parameters()]
    state = sum(p.to_local().numel() * 4 * 3 for p in b.model.parameters())  # params + exp_avg + exp_avg_sq
    m = b.sleep()
    print(m)
    assert m["memory/freed_bytes"] >= 0.99 * state
    b.wake_up()
    assert all(torch.equal(x, p.to_local()) for x, p in zip(before, b.model.parameters()))
    assert b.train([pack], [{"w": w}])["train/skipped"] == 0.0


def test_update_ref_copies_trained_actor_and_ref_stays_on_cpu(env):
    b = _backend(env, ref_model="small")
    pack = pack_samples(_samples(), pad_multiple=128)
    w = torch.full((pack.response_index.numel(),), 1.0 / pack.response_index.numel())
    assert b.train([pack], [{"w": w}])["train/skipped"] == 0.0
    actor = b.compute_log_prob([pack])[0].log_probs
    assert not torch.equal(actor, b.compute_log_prob([pack], model="ref")[0].log_probs)  # the step moved the actor
    m = b.update_ref()
    print(m)
    assert all(p.to_local().device.type == "cpu" for p in b.ref.parameters())  # still CPU-offloaded
    assert torch.equal(b.compute_log_prob([pack], model="ref")[0].log_probs, actor)


# Eager layers with flex_attention (not the default: flex runs inside compiled layers on CUDA): transformers compiles
# flex on its first call for that call's static shapes and recompiles with dynamic shapes at the next length, and
# the two kernels may round differently: the process's very first pass differs (4.8e-3 on one H200, 2026-12-02)
# while every later one matches (a suspected cause, not yet confirmed on the GPU). Known and open (docs/LOG.md); not
# strict because only whichever eager flex case runs first in the process is hit.
_EAGER_FLEX = pytest.mark.xfail(strict=False, reason="the first eager flex call's kernel differs (see above)")


@pytest.mark.parametrize("ac", [False, True], ids=["no_ac", "ac"])
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("attn", ["sdpa", "flex_attention"])
def test_log_prob_pass_is_the_training_forward(env, attn, compile, ac, request):
    """For every attention backend, with and without compiled layers and activation checkpointing, the actor's
    and the reference's log-prob passes return the bits the training forward computes (first-micro-batch PPO KL
    and ref KL with ref == actor exactly 0)."""
    if attn == "flex_attention" and not compile:
        request.applymarker(_EAGER_FLEX)
    seen = []

    def capture(logp, ent, inputs):
        seen.append(logp.detach().cpu())
        return (logp * 0).sum(), {}

    b = _backend(env, attn_implementation=attn, compile=compile, gradient_checkpointing=ac, ref_model="small")
    packs = [pack_samples(_samples(seed=s), pad_multiple=128) for s in (0, 1)]
    actor = [o.log_probs for o in b.compute_log_prob(packs)]
    ref = [o.log_probs for o in b.compute_log_prob(packs, model="ref")]
    with torch.no_grad():  # for the record: what a plain no-grad pass would give
        plain = [b.forward_pack(b.model, p, False)[0].cpu() for p in packs]
    b.model.reshard()
    b.train(packs, [{} for _ in packs], loss_fn=capture)  # the captures come before the optimizer step
    print(f"{attn} compile={compile} ac={ac}: max|no-grad pass - training forward| = "
          f"{[float((p - t).abs().max()) for p, t in zip(plain, seen)]}")
    diffs = [(float((a - t).abs().max()), float((r - t).abs().max())) for a, r, t in zip(actor, ref, seen)]
    print(f"{attn} compile={compile} ac={ac}: max|pass - training forward| actor/ref = {diffs}")
    assert all(torch.equal(a, t) for a, t in zip(actor, seen)), diffs
    assert all(torch.equal(r, t) for r, t in zip(ref, seen)), diffs
