"""RankStep, the one implementation of a rank's RL step: with identity reductions at one rank, and over gloo with
2 CPU processes (DPAllReduce) it gives the one-rank loss weights, IS weights, whitened advantages and summaries
for the same global batch.

The backend is a fake (deterministic log-probs, `train` records its loss inputs), so only the step is tested.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from dist_utils import free_port, spawn

from rlbench.algorithms import LossConfig, MISConfig
from rlbench.configs import BatchConfig
from rlbench.rank_step import RankStep, SingleRank
from rlbench.types import Sample

WORLD = 2
LOSS = LossConfig(use_tis=True, mis=MISConfig(use_tis=True, use_rs=True, tis_batch_normalize=True),
                  loss_aggregation="token_mean")
BATCH = BatchConfig(global_batch_size=8, use_dynamic_batch_size=True, max_tokens_per_gpu=40)


def make_samples(n: int = 16) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        length = int(torch.randint(6, 20, (1,), generator=g))
        resp = int(torch.randint(2, length - 1, (1,), generator=g))
        mask = (torch.rand(resp, generator=g) > 0.2).int().tolist()
        out.append(Sample(tokens=torch.randint(1, 128, (length,), generator=g).tolist(), response_length=resp,
                          loss_mask=mask, token_advantages=torch.randn(resp, generator=g).tolist(),
                          rollout_log_probs=(-0.01 * torch.rand(resp, generator=g)).tolist(), index=i))
    return out


class FakeBackend:
    """Log-prob of a response token = -tokens/100; `train` runs the loss on those and records its inputs."""

    def __init__(self) -> None:
        self.inputs: list = []

    @staticmethod
    def _logp(pack) -> torch.Tensor:
        return -pack.tokens[pack.response_index].float() / 100  # [R]

    def compute_log_prob(self, packs, *, model="actor", with_entropy=False):
        return [SimpleNamespace(log_probs=self._logp(p) * (1.5 if model == "ref" else 1.0)) for p in packs]

    def train(self, packs, loss_inputs, loss_fn=None):
        for p, inputs in zip(packs, loss_inputs):
            loss_fn(self._logp(p), None, inputs)
        self.inputs.append(list(loss_inputs))
        return {"train/loss": 0.0, "train/step": float(len(self.inputs)), "perf/train_time": 0.0}


# REINFORCE++ (discounted returns over the trained tokens, whitened over the global batch): its token-level half
# runs on the ranks, whitening statistics through the reductions
RPP = LossConfig(advantage_estimator="reinforce_plus_plus", normalize_advantages=True, gamma=0.9)


def by_sample(packs, values, steps) -> dict[int, torch.Tensor]:
    """`[step][micro-batch] -> [R]` values split per sample, keyed by `Sample.index`."""
    out = {}
    for s, (step_packs, step_values) in enumerate(zip(packs, values)):
        for pack, v in zip(step_packs, step_values):
            out |= {steps[s][i].index: x for i, x in zip(pack.sample_ids, torch.split(v, pack.response_lengths))}
    return out


def run_step(step: RankStep, steps: list[list[Sample]]) -> dict:
    """Pack, log-probs, advantages, train; per sample (by index) its token weights, IS weights and REINFORCE++
    advantages, plus the metrics and this rank's first micro-batch's mean |log π − log π_rollout| by hand."""
    packs = step.pack(steps)
    old, ref, lp_metrics = step.compute_log_probs(packs)
    adv, adv_metrics = step.compute_advantages(packs, old, ref)
    metrics = step.train(packs, old, ref, adv)
    per_sample = {}
    for s, step_inputs in enumerate(step.backend.inputs):
        for pack, inputs in zip(packs[s], step_inputs):
            weights = torch.split(inputs.token_weights, pack.response_lengths)
            is_weights = torch.split(inputs.is_weights, pack.response_lengths)
            for i, w, is_w in zip(pack.sample_ids, weights, is_weights):
                per_sample[steps[s][i].index] = (w, is_w)
    rpp_adv, rpp_metrics = RankStep(BATCH, RPP, step.backend, reduce=step.reduce).compute_advantages(packs)
    first = packs[0][0]
    on = first.loss_mask != 0
    gap = (FakeBackend._logp(first) - first.rollout_log_probs).abs()[on]
    return {"per_sample": per_sample, "metrics": lp_metrics | adv_metrics | metrics, "n_packs": [len(p) for p in packs],
            "adv": by_sample(packs, adv, steps), "rpp": by_sample(packs, rpp_adv, steps),
            "rpp_mean": rpp_metrics["rollout/advantages"], "first_mb": (float(gap.double().sum()), int(on.sum()))}


def single_rank() -> dict:
    samples = make_samples()
    steps = [samples[s : s + BATCH.global_batch_size] for s in range(0, len(samples), BATCH.global_batch_size)]
    return run_step(RankStep(BATCH, LOSS, FakeBackend()), steps)


def test_single_rank_reductions_are_the_identity():
    r = SingleRank()
    assert r.sum([3, 2.5]) == [3, 2.5] and r.max(4) == 4


def test_cp_ranks_share_the_token_budget_of_a_micro_batch():
    samples = make_samples(8)
    counts = {}
    for cp in (1, 2):
        packs = RankStep(BATCH, LOSS, FakeBackend(), cp_size=cp).pack([samples])[0]
        assert all(p.num_tokens <= BATCH.max_tokens_per_gpu * cp for p in packs)
        assert sorted(i for p in packs for i in p.sample_ids) == list(range(8))
        counts[cp] = len(packs)
    assert counts[1] > counts[2] >= 1  # a CP group packs max_tokens_per_gpu * cp_size tokens per micro-batch


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from rlbench.rank_step import DPAllReduce

    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        samples = make_samples()
        gbs = BATCH.global_batch_size
        # rank r holds samples r, r+2, ... of each global batch (the driver's split; any split gives the same)
        steps = [samples[s : s + gbs][rank::WORLD] for s in range(0, len(samples), gbs)]
        result = run_step(RankStep(BATCH, LOSS, FakeBackend(), reduce=DPAllReduce(None)), steps)
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    out = str(tmp_path_factory.mktemp("rank_step"))
    spawn(_worker, args=(free_port(), out), nprocs=WORLD)
    return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]


def test_two_ranks_match_one_rank(two_ranks):
    ref = single_rank()
    assert two_ranks[0]["n_packs"] == two_ranks[1]["n_packs"]  # the DP-wide MAX micro-batch count
    merged = two_ranks[0]["per_sample"] | two_ranks[1]["per_sample"]
    assert sorted(merged) == sorted(ref["per_sample"]) == list(range(16))
    for i, (w, is_w) in ref["per_sample"].items():
        torch.testing.assert_close(merged[i][0], w, rtol=1e-6, atol=1e-9)  # global token_mean normaliser
        torch.testing.assert_close(merged[i][1], is_w, rtol=1e-6, atol=1e-9)  # DP-summed MIS batch stats
    for key in ("rollout/log_probs", "rollout/rollout_log_probs", "rollout/advantages"):
        assert two_ranks[0]["metrics"][key] == two_ranks[1]["metrics"][key]  # global on every rank
        assert two_ranks[0]["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-6, abs=1e-7), key
    # the first micro-batch's training forward against the rollout's log-probs: every rank's first one, pooled
    key = "train/first_mb_kl_vs_rollout"
    assert two_ranks[0]["metrics"][key] == two_ranks[1]["metrics"][key]
    (gap, n), pooled = ref["first_mb"], [r["first_mb"] for r in two_ranks]
    assert ref["metrics"][key] == pytest.approx(gap / n, rel=1e-6) and gap > 0  # old == new, not the rollout
    assert two_ranks[0]["metrics"][key] == pytest.approx(sum(g for g, _ in pooled) / sum(c for _, c in pooled), rel=1e-6)


def test_one_rank_advantages_are_the_whole_batch_ones():
    """The token-level half on the ranks: GRPO's passes the packs' values through; REINFORCE++ returns whitened over
    the global batch are, at one rank, bit for bit `token_advantages` of the whole batch in one call."""
    from rlbench.algorithms import token_advantages

    ref = single_rank()
    samples = make_samples()
    for i, s in enumerate(samples):
        assert torch.equal(ref["adv"][i], torch.tensor(s.token_advantages, dtype=torch.float32))
    base = torch.cat([torch.tensor(s.token_advantages, dtype=torch.float32) for s in samples])
    mask = torch.cat([torch.tensor(s.loss_mask, dtype=torch.float32) for s in samples])
    want = token_advantages(RPP, base, [s.response_length for s in samples], mask)
    got = torch.cat([ref["rpp"][i] for i in range(len(samples))])
    assert torch.equal(got, want)
    assert ref["rpp_mean"] == float((want * mask).sum() / mask.sum())


def test_two_ranks_whiten_over_the_global_batch(two_ranks):
    ref = single_rank()
    merged = two_ranks[0]["rpp"] | two_ranks[1]["rpp"]
    assert sorted(merged) == list(range(16))
    for i, want in ref["rpp"].items():
        torch.testing.assert_close(merged[i], want, rtol=1e-5, atol=1e-6)
    assert two_ranks[0]["rpp_mean"] == two_ranks[1]["rpp_mean"] == pytest.approx(ref["rpp_mean"], abs=1e-6)


# Lengths where CP's slot alignment (2*cp = 4) changes the count: rank 0's 5+5+5 raw tokens fit one 16-token
# micro-batch (8 per GPU x cp 2) but its aligned slots 8+8+8 need two; rank 1's 4+4+4 fit one either way.
CP_BATCH = BatchConfig(global_batch_size=6, use_dynamic_batch_size=True, max_tokens_per_gpu=8)
CP_LENGTHS = [[5, 5, 5], [3, 3, 3]]


def _cp_pack_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from rlbench.rank_step import DPAllReduce

    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        samples = [Sample(tokens=[7] * n, response_length=2, loss_mask=[1, 1], index=i)
                   for i, n in enumerate(CP_LENGTHS[rank])]
        packs = RankStep(CP_BATCH, LOSS, FakeBackend(), cp_size=2, reduce=DPAllReduce(None)).pack([samples])[0]
        result = {"tokens": [p.num_tokens for p in packs], "ids": sorted(i for p in packs for i in p.sample_ids)}
        torch.save(result, os.path.join(out, f"cp_rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_cp_alignment_counts_are_equal_over_dp_and_within_budget(tmp_path):
    spawn(_cp_pack_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD)
    ranks = [torch.load(os.path.join(tmp_path, f"cp_rank{r}.pt")) for r in range(WORLD)]
    assert [len(r["tokens"]) for r in ranks] == [2, 2]  # the DP MAX of the aligned counts (2, 1)
    budget = CP_BATCH.max_tokens_per_gpu * 2
    for r in ranks:
        assert r["ids"] == [0, 1, 2] and all(0 < t <= budget for t in r["tokens"])
    assert sorted(ranks[0]["tokens"]) == [8, 16] and sorted(ranks[1]["tokens"]) == [4, 8]  # slots of 8 / of 4
