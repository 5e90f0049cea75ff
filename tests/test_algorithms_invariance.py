"""The global-batch loss, its gradient and the summed metrics do not depend on the micro-batch split
(1, 3, 8 micro-batches) or on the DP split (2 simulated ranks), for every aggregation mode and with
GSPO sequence ratios, OPSM, KL, entropy, TIS and MIS batch normalisation."""

import pytest
import torch

from rlbench.algorithms import (
    GlobalNorm,
    LossConfig,
    MISConfig,
    ResponseBatch,
    build_loss,
    build_loss_inputs,
    global_norm,
    is_batch_stats,
    token_logprobs,
)

D = torch.float64
N_SAMPLES, HID, VOCAB = 12, 6, 9


def _samples(seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9, (N_SAMPLES,), generator=g).tolist()
    out = []
    for n in lengths:
        mask = (torch.rand(n, generator=g) > 0.2).to(D)
        feats = torch.randn(n, HID, generator=g, dtype=D)
        targets = torch.randint(0, VOCAB, (n,), generator=g)
        out.append(dict(n=n, mask=mask, feats=feats, targets=targets, adv=torch.randn(n, generator=g, dtype=D),
                        noise=0.3 * torch.randn(3, n, generator=g, dtype=D)))
    return out


def _policy(W, s):
    return token_logprobs(s["feats"] @ W, s["targets"], 0.8, chunk_size=4)


def _batch(W0, samples, idx):
    """A ResponseBatch of the given samples; old/rollout/ref are the initial policy plus fixed noise."""
    parts = [samples[i] for i in idx]
    with torch.no_grad():
        lp0 = [_policy(W0, s)[0] for s in parts]
    cat = torch.cat
    return ResponseBatch(
        loss_mask=cat([s["mask"] for s in parts]), advantages=cat([s["adv"] for s in parts]),
        response_lengths=[s["n"] for s in parts],
        old_log_probs=cat([lp + s["noise"][0] for lp, s in zip(lp0, parts)]),
        rollout_log_probs=cat([lp + s["noise"][1] for lp, s in zip(lp0, parts)]),
        ref_log_probs=cat([lp + s["noise"][2] for lp, s in zip(lp0, parts)]),
    )


def _run(cfg, samples, W0, ranks):
    """ranks: list (DP ranks) of lists (micro-batches) of sample indices. Returns loss, grad, metrics."""
    W = W0.clone().requires_grad_()
    per_rank = [[_batch(W0, samples, mb) for mb in mbs] for mbs in ranks]
    norm = GlobalNorm.combine([global_norm(cfg, mbs) for mbs in per_rank])  # all-reduce(SUM) of counts
    stats = [is_batch_stats(cfg, mbs) for mbs in per_rank]
    stats = None if stats[0] is None else sum(stats)  # all-reduce(SUM) of MIS stats
    loss_fn, total, metrics = build_loss(cfg), 0.0, {}
    for mbs, rank_mbs in zip(ranks, per_rank):
        for idx, inputs in zip(mbs, build_loss_inputs(cfg, rank_mbs, norm=norm, batch_stats=stats)):
            lps, ents = zip(*(_policy(W, samples[i]) for i in idx))
            loss, m = loss_fn(torch.cat(lps), torch.cat(ents), inputs)
            loss.backward()  # gradients SUM over micro-batches and ranks
            total += loss.item()
            for k, v in m.items():
                metrics[k] = metrics.get(k, 0.0) + v.item()
    return total, W.grad, metrics


def _split(seq, k):
    step = -(-len(seq) // k)
    return [seq[i : i + step] for i in range(0, len(seq), step)]


CONFIGS = [
    dict(loss_aggregation="sample_mean", use_tis=True, entropy_coef=0.01),
    dict(loss_aggregation="token_mean", policy_loss="gspo", eps_clip=0.05, use_kl_loss=True, kl_loss_coef=0.1,
         kl_loss_type="k3"),
    dict(loss_aggregation="seq_sum_constant", loss_aggregation_constant=8.0, policy_loss="cispo", use_opsm=True),
    dict(loss_aggregation="sample_mean", eps_clip_c=3.0, use_tis=True, mis=MISConfig(tis_level="sequence")),
    dict(loss_aggregation="token_mean", use_tis=True, mis=MISConfig(tis_mode="clip"), use_kl_loss=True,
         kl_loss_coef=0.05, kl_loss_type="low_var_kl", use_unbiased_kl=True),
    dict(loss_aggregation="sample_mean", use_rollout_logprobs=True, use_opsm=True),
]


@pytest.mark.parametrize("kw", CONFIGS)
def test_loss_grad_metrics_invariant_to_micro_and_dp_split(kw):
    cfg = LossConfig(**kw)
    samples = _samples()
    W0 = torch.randn(HID, VOCAB, generator=torch.Generator().manual_seed(1), dtype=D)
    order = list(range(N_SAMPLES))
    ref_loss, ref_grad, ref_m = _run(cfg, samples, W0, [[order]])
    assert ref_grad.abs().sum() > 0
    splits = [
        [_split(order, 3)],
        [_split(order, 8)],
        [_split(order[0::2], 3), _split(order[1::2], 2)],  # 2 DP ranks, unequal micro-batch counts
    ]
    for ranks in splits:
        loss, grad, m = _run(cfg, samples, W0, ranks)
        assert abs(loss - ref_loss) < 1e-12, ranks
        torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-13)
        assert m.keys() == ref_m.keys()
        for k in m:
            assert abs(m[k] - ref_m[k]) < 1e-10 * max(1.0, abs(ref_m[k])), k


def test_sample_mean_metric_is_mean_of_sample_means():
    cfg = LossConfig()
    samples = _samples(2)
    W0 = torch.randn(HID, VOCAB, generator=torch.Generator().manual_seed(3), dtype=D)
    _, _, m = _run(cfg, samples, W0, [_split(list(range(N_SAMPLES)), 4)])
    exp = 0.0
    for s in samples:
        d = (s["noise"][0] - s["noise"][1]).abs()  # |old − rollout|
        exp += float((d * s["mask"]).sum() / max(1.0, float(s["mask"].sum()))) / N_SAMPLES
    assert abs(m["train_rollout_logprob_abs_diff"] - exp) < 1e-12
