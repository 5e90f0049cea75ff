"""The log-prob passes run the training forward's numerics on the GPU: for every attention backend, with and
without compiled layers and activation checkpointing, the actor's and the reference's log-prob passes return
the bits the training forward computes (first-micro-batch PPO KL and ref KL with ref == actor exactly 0).

Run on the GPU machine: `pytest -m gpu tests/test_logprob_numerics_gpu.py -q -s`.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

from rlbench.packing.pack import pack_samples  # noqa: E402
from rlbench.types import Sample  # noqa: E402


def _samples(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(60, 400, (1,), generator=g))
        out.append(Sample(tokens=torch.randint(0, 128, (length,), generator=g).tolist(), response_length=length // 2))
    return out


@pytest.fixture(scope="module")
def env():
    from rlbench.distributed.mesh import init_distributed

    return init_distributed("cuda")


@pytest.mark.parametrize("ac", [False, True], ids=["no_ac", "ac"])
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("attn", ["sdpa", "flex_attention"])
def test_log_prob_pass_is_the_training_forward(env, attn, compile, ac):
    from rlbench.backends.fsdp.actor import FSDPBackend
    from rlbench.backends.fsdp.config import FSDPConfig, OptimConfig

    seen = []

    def loss_fn(logp, ent, inputs):
        seen.append(logp.detach().cpu())
        return (logp * 0).sum(), {}

    cfg = FSDPConfig(model="small", device="cuda", attn_implementation=attn, compile=compile,
                     gradient_checkpointing=ac, ref_model="small", optim=OptimConfig(lr=0.0))
    b = FSDPBackend(cfg, env=env, loss_fn=loss_fn)
    b.init()
    packs = [pack_samples(_samples(seed=s), pad_multiple=128) for s in (0, 1)]
    actor = [o.log_probs for o in b.compute_log_prob(packs)]
    ref = [o.log_probs for o in b.compute_log_prob(packs, model="ref")]
    with torch.no_grad():  # for the record: what a plain no-grad pass would give
        plain = [b.forward_pack(b.model, p, False)[0].cpu() for p in packs]
    b.model.reshard()
    b.train(packs, [{} for _ in packs])
    print(f"{attn} compile={compile} ac={ac}: max|no-grad pass - training forward| = "
          f"{[float((p - t).abs().max()) for p, t in zip(plain, seen)]}")
    diffs = [(float((a - t).abs().max()), float((r - t).abs().max())) for a, r, t in zip(actor, ref, seen)]
    print(f"{attn} compile={compile} ac={ac}: max|pass - training forward| actor/ref = {diffs}")
    assert all(torch.equal(a, t) for a, t in zip(actor, seen)), diffs
    assert all(torch.equal(r, t) for r, t in zip(ref, seen)), diffs
