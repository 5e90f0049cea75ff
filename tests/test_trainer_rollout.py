"""Rollout manager with a scripted fake engine: groups, rewards, dynamic sampling, truncation, pass@k."""

from __future__ import annotations

import math
import random

import pytest

from rlbench.configs import EvalConfig, RolloutConfig
from rlbench.data import DataConfig, PromptDataset, build_tokenizer, make_arithmetic, write_jsonl
from rlbench.engine.protocol import Generation
from rlbench.metrics import pass_at_k
from rlbench.rollout.manager import RolloutManager
from rlbench.types import Status


class ScriptedEngine:
    """Answers each arithmetic prompt correctly with probability `p_correct[label]` (default `p`), seeded."""

    def __init__(self, tokenizer, p=0.5, truncate_every=0):
        self.tok, self.p, self.truncate_every = tokenizer, p, truncate_every
        self.weight_version = 7
        self.calls = []

    def generate(self, prompts, sampling, seeds=None):
        self.calls.append((len(prompts), sampling.n, list(seeds)))
        out = []
        for i, prompt in enumerate(prompts):
            text = self.tok.decode(prompt)
            a, op, b = _parse(text)
            answer = a + b if op == "+" else a - b
            for j in range(sampling.n):
                rng = random.Random(seeds[i] + j)
                wrong = rng.random() >= self.p
                resp = f"\\boxed{{{answer + (1 if wrong else 0)}}}"
                ids = self.tok(resp, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
                reason = "stop"
                if self.truncate_every and (i * sampling.n + j) % self.truncate_every == 0:
                    ids, reason = ids[:3], "length"
                out.append(Generation(i, ids, [-0.5] * len(ids), reason, self.weight_version, j))
        return out


def _parse(text):
    body = text.split("user\n")[1].split("=?")[0]
    op = "+" if "+" in body else "-"
    a, b = body.rsplit(op, 1)
    return int(a), op, int(b)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _dataset(tmp_path, tok, n=64):
    path = str(tmp_path / "arith.jsonl")
    write_jsonl(make_arithmetic(n, seed=3), path)
    return PromptDataset(DataConfig(path=path), tok)


def test_groups_rewards_versions(tmp_path, tok):
    engine = ScriptedEngine(tok, p=1.0)
    mgr = RolloutManager(RolloutConfig(rollout_batch_size=4, n_samples_per_prompt=3), engine, _dataset(tmp_path, tok), tok)
    batch = mgr.generate(0)
    assert len(batch.samples) == 12 and len(batch.groups) == 4
    assert [s.group_index for s in batch.samples] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert [s.index for s in batch.samples] == list(range(12))
    assert all(s.reward == 1.0 and s.weight_version == 7 for s in batch.samples)
    assert all(s.prompt_tokens + s.response_tokens == s.tokens for s in batch.samples)
    assert batch.metrics["rollout/raw_reward"] == 1.0
    assert batch.metrics["rollout/zero_std/count_1"] == 4.0
    second = mgr.generate(1)
    assert second.samples[0].group_index == 4 and second.samples[0].index == 12


def test_seeds_depend_only_on_rollout_id(tmp_path, tok):
    runs = []
    for _ in range(2):
        engine = ScriptedEngine(tok)
        mgr = RolloutManager(RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=2), engine, _dataset(tmp_path, tok), tok)
        mgr.generate(0)
        mgr.generate(1)
        runs.append(engine.calls)
    assert runs[0] == runs[1]
    assert runs[0][0][2] != runs[0][1][2]


def test_dynamic_sampling_drops_equal_groups_and_refills(tmp_path, tok):
    engine = ScriptedEngine(tok, p=0.5)
    cfg = RolloutConfig(rollout_batch_size=4, n_samples_per_prompt=2, dynamic_sampling=True, over_sampling_batch_size=6)
    batch = RolloutManager(cfg, engine, _dataset(tmp_path, tok), tok).generate(0)
    assert len(batch.groups) == 4
    assert all(len({s.reward for s in g}) == 2 for g in batch.groups)  # every kept group has signal
    m = batch.metrics
    generated = 6 * m["rollout/dynamic_filter/rounds"]
    assert m["rollout/dynamic_filter/drop_zero_std"] == m["rollout/zero_std/count"] > 0
    assert generated - m["rollout/dynamic_filter/drop_zero_std"] >= 4
    assert all(call[0] == 6 for call in engine.calls)


def test_dynamic_sampling_out_of_rounds_keeps_shape(tmp_path, tok):
    engine = ScriptedEngine(tok, p=1.0)  # every group has equal rewards
    cfg = RolloutConfig(rollout_batch_size=3, n_samples_per_prompt=2, dynamic_sampling=True, max_sampling_rounds=2)
    batch = RolloutManager(cfg, engine, _dataset(tmp_path, tok), tok).generate(0)
    assert len(batch.samples) == 6
    assert batch.metrics["rollout/dynamic_filter/refilled_with_dropped"] == 3.0
    assert batch.metrics["rollout/dynamic_filter/rounds"] == 2.0


def test_truncation_status_and_mask(tmp_path, tok):
    engine = ScriptedEngine(tok, p=1.0, truncate_every=2)
    cfg = RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=2, mask_truncated=True)
    batch = RolloutManager(cfg, engine, _dataset(tmp_path, tok), tok).generate(0)
    trunc = [s for s in batch.samples if s.status == Status.TRUNCATED]
    assert len(trunc) == 2 and batch.metrics["rollout/truncated_ratio"] == 0.5
    assert all(sum(s.loss_mask) == 0 for s in trunc)
    assert all(s.reward == 0.0 for s in trunc)  # "\bo" has no boxed answer


def test_evaluate_pass_at_k(tmp_path, tok):
    engine = ScriptedEngine(tok, p=0.5)
    mgr = RolloutManager(RolloutConfig(), engine, _dataset(tmp_path, tok), tok)
    items = _dataset(tmp_path, tok, n=20).items
    out = mgr.evaluate(items, EvalConfig(n_samples_per_prompt=4, pass_k=(1, 2, 4)))
    # recompute from the engine's own seeds
    rewards = []
    for seed in engine.calls[0][2]:
        rewards.append([float(random.Random(seed + j).random() < 0.5) for j in range(4)])
    ref1 = sum(sum(r) / 4 for r in rewards) / 20
    ref4 = sum(float(sum(r) > 0) for r in rewards) / 20
    assert out["eval/pass@1"] == pytest.approx(ref1) and out["eval/reward"] == pytest.approx(ref1)
    assert out["eval/pass@4"] == pytest.approx(ref4)
    assert out["eval/pass@1"] <= out["eval/pass@2"] <= out["eval/pass@4"]
    again = mgr.evaluate(items, EvalConfig(n_samples_per_prompt=4, pass_k=(1, 2, 4)))
    assert again["eval/pass@2"] == out["eval/pass@2"]  # fixed eval seed


@pytest.mark.parametrize("n,c,k", [(4, 0, 1), (4, 1, 1), (4, 2, 2), (5, 3, 2), (10, 1, 10), (8, 7, 3)])
def test_pass_at_k_matches_combinatorics(n, c, k):
    from itertools import combinations

    subsets = list(combinations([1] * c + [0] * (n - c), k))
    ref = sum(any(s) for s in subsets) / len(subsets)
    assert math.isclose(pass_at_k(n, c, k), ref, rel_tol=0, abs_tol=1e-12)
