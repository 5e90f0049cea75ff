"""The rollout manager: prompt batches -> n samples per prompt -> rewards, with dynamic sampling and eval.

    manager = RolloutManager(cfg.rollout, engine, dataset, tokenizer)
    batch = manager.generate(rollout_id=0)        # RolloutBatch: samples (rewards set), metrics
    scores = manager.evaluate(eval_items, cfg.eval)   # eval/reward, eval/pass@k, ...

A round's prompts become sample groups through the generate function (`rlbench.rollout.generate`: single-turn by
default, `rollout.custom_generate_function_path` for another, e.g. multi-turn tool calling), which uses the engine
through its protocol only, so any engine works. A reward model
(`reward_model=`, `rlbench.reward_model.serve.RewardModel`, any object with `score_samples(samples)` and `version`)
scores each round's samples in one batched call after generation; the training reward is then the weighted sum
`cfg.reward_mix` of it and the rule rewards (the rm_type reward is kept per sample in `metadata["rule_reward"]`, the
model's score in `metadata["rm_score"]`). Evaluation scores with the rule reward alone. With `reward_workers` > 0 rewards are scored in worker processes (`reward_pool.RewardPool`); a generate
function that reports samples as they finish (the default does on the torch engine, the multi-turn one as each
trajectory ends) has them scored while the rest generate.
Sampling seeds derive from (rollout seed, rollout id, refill round, prompt), so a resumed run draws
exactly what the uninterrupted run drew. Advantages are not computed here (the Trainer's `score`
step does it with the configured estimator); groups stay contiguous and in prompt order.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from rlbench.configs.rollout import RM_NAME
from rlbench.engine.protocol import SamplingParams
from rlbench.metrics import pass_at_k, summarize
from rlbench.rewards import RewardError, check_reward, combine_rewards, describe_sample, score_batch
from rlbench.rollout.generate import GenerateArgs, check_groups, load_generate_fn
from rlbench.rollout.reward_pool import RewardPool, poolable
from rlbench.types import Sample, Status


@dataclass
class RolloutBatch:
    """The samples of one rollout (groups contiguous, `n_samples_per_prompt` each) and its metrics."""

    samples: list[Sample]
    """All kept samples, group by group; rewards are set, per-sample advantages are set by `Trainer.score`."""
    metrics: dict[str, float] = field(default_factory=dict)
    """`rollout/*` and `perf/rollout_time`."""
    rollout_id: int = 0
    """Which rollout produced the batch."""
    packs: list | None = None
    """Set by `Trainer.pack`: `[optimizer step][micro-batch] -> Pack`."""
    old_log_probs: list | None = None
    """Set by `Trainer.compute_log_probs`: `[step][micro-batch] -> [R]` actor log-probs (None in bypass mode)."""
    ref_log_probs: list | None = None
    """Set by `Trainer.compute_log_probs`: `[step][micro-batch] -> [R]` reference log-probs (or None)."""
    advantages: list | None = None
    """Set by `Trainer.compute_advantages`: `[step][micro-batch] -> [R]` token-level advantages."""
    values: list | None = None
    """PPO with a critic, set by `Trainer.compute_values`: `[step][micro-batch] -> [R]` the critic's V_old."""
    returns: list | None = None
    """PPO with a critic, set by `Trainer.compute_advantages`: `[step][micro-batch] -> [R]` the critic's targets."""

    @property
    def groups(self) -> list[list[Sample]]:
        """Samples grouped by `group_index`, in order."""
        out: dict[int, list[Sample]] = {}
        for s in self.samples:
            out.setdefault(s.group_index, []).append(s)
        return list(out.values())

    @property
    def rewards(self) -> list[float]:
        return [float(s.reward) for s in self.samples]


class RolloutManager:
    """Turns prompts into scored sample groups using a RolloutEngine.

    Args:
        cfg: `RolloutConfig` (batch size, group size, sampling, reward, dynamic sampling).
        engine: a `RolloutEngine`.
        dataset: a `PromptDataset` (or anything with `next_batch(n) -> list[PromptItem]`).
        tokenizer: decodes responses for the reward and supplies the stop (eos) token.
        reward_workers: processes that score rewards (0: inline, in this thread, after generation).
        reward_model: the reward model `cfg.reward_model` names, built (`score_samples(samples) -> list[float]`,
            `version`, `version_id`); None when the config has none.
    """

    def __init__(self, cfg, engine, dataset, tokenizer, reward_workers: int = 0, reward_model=None) -> None:
        self.cfg = cfg
        self.engine = engine
        self.dataset = dataset
        self.tokenizer = tokenizer
        self.stop_token_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self.next_group = 0  # global group / sample ids keep increasing over the run
        self.next_index = 0
        self.generate_fn = load_generate_fn(cfg.custom_generate_function_path)
        """Turns a round's prompt items into sample groups (`rlbench.rollout.generate.GenerateFn`)."""
        self.reward_pool = RewardPool(reward_workers, cfg.reward_timeout) if reward_workers > 0 else None
        self._reward_wait = 0.0  # seconds spent waiting for rewards after generation, this rollout
        if (cfg.reward_model is not None) != (reward_model is not None):
            raise ValueError(f"rollout.reward_model={cfg.reward_model!r} but the manager was given "
                             f"{'no' if reward_model is None else 'a'} reward model; build it from the config "
                             "(rlbench.orchestration.local.build_rollouts)")
        self.reward_model = reward_model
        self.reward_mix = cfg.reward_mix  # None: the rule reward is the training reward, untouched
        self._rm_time = 0.0  # seconds the reward model scored, this rollout
        self.progress: Callable[[int], None] | None = None
        """When set, called with how many samples just finished (training rounds and eval): one by one as an
        engine that reports them (the torch engine's `on_finish`) stops each, the rest when the generate call
        returns. A progress bar's `update` (`rlbench.progress.Progress`, the CLI's rollout bar)."""

    def sampling(self, n: int, temperature: float | None = None, max_new_tokens: int | None = None) -> SamplingParams:
        """The engine's SamplingParams for `n` samples per prompt."""
        c = self.cfg
        return SamplingParams(
            temperature=c.temperature if temperature is None else temperature,
            top_p=c.top_p, top_k=c.top_k, n=n,
            max_new_tokens=max_new_tokens or c.max_response_len,
            stop_token_ids=list(self.stop_token_ids), ignore_eos=c.ignore_eos,
        )

    def generate(self, rollout_id: int) -> RolloutBatch:
        """One rollout of `rollout_batch_size` groups (refilled by over-sampling under dynamic sampling)."""
        c = self.cfg
        start = time.perf_counter()
        self._reward_wait = self._rm_time = 0.0
        kept, dropped, all_groups = [], [], []
        rounds = 0
        while len(kept) < c.rollout_batch_size and rounds < c.max_sampling_rounds:
            items = self.dataset.next_batch(c.prompts_per_round)
            groups = self._sample_groups(items, c.n_samples_per_prompt, prompt_seeds(c.seed, rollout_id, rounds, len(items), c.n_samples_per_prompt))
            if self.reward_mix is not None:
                self._mix_rewards([s for g in groups for s in g])
            for group in groups:
                (dropped if c.dynamic_sampling and _equal_rewards(group) else kept).append(group)
            all_groups += groups
            rounds += 1
        refill = max(0, c.rollout_batch_size - len(kept))
        kept = (kept + dropped[:refill])[: c.rollout_batch_size]  # out of rounds: keep the shape with dropped groups
        samples = [s for g in kept for s in g]
        self._renumber(kept)
        if c.mask_truncated:
            for s in samples:
                if s.status == Status.TRUNCATED:
                    s.loss_mask = [0] * s.response_length
        metrics = rollout_metrics(samples, all_groups)
        metrics |= {
            "perf/reward_wait_time": self._reward_wait,
            "rollout/dynamic_filter/drop_zero_std": float(len(dropped)),
            "rollout/dynamic_filter/rounds": float(rounds),
            "rollout/dynamic_filter/refilled_with_dropped": float(refill),
            "perf/rollout_time": time.perf_counter() - start,
        }
        if self.reward_mix is not None:
            metrics |= self._mix_metrics(samples)
        gen_tokens = sum(s.response_length for g in all_groups for s in g)
        metrics["perf/rollout_tokens_per_sec"] = gen_tokens / max(metrics["perf/rollout_time"], 1e-9)
        return RolloutBatch(samples=samples, metrics=metrics, rollout_id=rollout_id)

    def _mix_rewards(self, samples: list[Sample]) -> None:
        """Set each sample's training reward to `reward_mix` over its terms: "rm" from the reward model (one
        batched call), the rm_type name from the rule reward already scored, other names scored by that function."""
        start = time.perf_counter()
        rule = [float(s.reward) for s in samples]
        terms: dict[str, list[float]] = {}
        for name in self.reward_mix:
            if name == RM_NAME:
                terms[name] = self._rm_scores(samples)
            elif name == self.cfg.rm_type:
                terms[name] = rule
            else:
                terms[name] = score_batch([s.response for s in samples], labels=[s.label for s in samples],
                                          rm_type=name, timeout=self.cfg.reward_timeout)
        for i, (s, total) in enumerate(zip(samples, combine_rewards(self.reward_mix, terms))):
            s.metadata["rule_reward"] = rule[i]
            if RM_NAME in terms:
                s.metadata["rm_score"], s.metadata["rm_version"] = terms[RM_NAME][i], self.reward_model.version
            s.reward = total
        self._rm_time += time.perf_counter() - start

    def _rm_scores(self, samples: list[Sample]) -> list[float]:
        """The reward model's score of every sample, each checked finite (a NaN names the sample)."""
        scores = self.reward_model.score_samples(samples)
        if len(scores) != len(samples):
            raise RewardError(f"reward model {self.reward_model.version} returned {len(scores)} scores for "
                              f"{len(samples)} samples")
        return [check_reward(v, f"reward model {self.reward_model.version} on {describe_sample(s, i)}")
                for i, (s, v) in enumerate(zip(samples, scores))]

    def _mix_metrics(self, samples: list[Sample]) -> dict[str, float]:
        """`rollout/rule_reward` (the rm_type reward) and, with a reward model, `rollout/rm_score` and
        `rollout/rm_version` (`version_id`) of the kept samples; `perf/rm_time`."""
        out = {"rollout/rule_reward": float(np.mean([s.metadata["rule_reward"] for s in samples])),
               "perf/rm_time": self._rm_time}
        if self.reward_model is not None:
            out["rollout/rm_score"] = float(np.mean([s.metadata["rm_score"] for s in samples]))
            out["rollout/rm_version"] = float(self.reward_model.version_id)
        return out

    def _sample_groups(self, items, n: int, seeds: list[int], **sampling) -> list[list[Sample]]:
        """Generate n samples for each prompt item and score them; one group (list of n Samples) per item.

        Stopped (Ctrl-C, an error) while rewards are still being scored, the pool's workers holding those jobs are
        replaced: nobody waits for them, and one stuck in a hung reward would hold the next rollout's jobs."""
        try:
            return self._generate_and_score(items, n, seeds, **sampling)
        except BaseException:
            if self.reward_pool is not None:
                self.reward_pool.restart_busy()
            raise

    def _generate_and_score(self, items, n: int, seeds: list[int], **sampling) -> list[list[Sample]]:
        prompts = [it.prompt_token_ids for it in items]
        if any(p is None for p in prompts):
            raise ValueError("prompt items have no prompt_token_ids; build the PromptDataset with a tokenizer")
        early: dict[int, tuple[Sample, Future | None]] = {}  # scored while the rest generate
        progress = self.progress

        def on_sample(index: int, sample: Sample) -> None:
            early[index] = sample, None if self.reward_pool is None else self._submit(sample, index)
            if progress is not None:
                progress(1)

        wants = self.reward_pool is not None or progress is not None
        args = GenerateArgs(self.engine, self.tokenizer, self.cfg, on_sample if wants else None)
        groups = self.generate_fn(args, items, self.sampling(n, **sampling), seeds)
        flat = check_groups(groups, len(items), n, self.cfg.custom_generate_function_path or "single_turn")
        if progress is not None and len(flat) > len(early):  # an engine that does not report samples as they end
            progress(len(flat) - len(early))
        start = time.perf_counter()
        pairs = [early[i] if i in early and early[i][0] is s else (s, None) for i, s in enumerate(flat)]
        for s, r in zip([s for s, _ in pairs], self._rewards(pairs)):
            s.reward = r
        self._reward_wait += time.perf_counter() - start
        return [[s for s, _ in pairs[i * n : (i + 1) * n]] for i in range(len(items))]

    def _record(self, sample: Sample, index: int) -> tuple | None:
        """`sample` as a `RewardPool` record (its reward name: the row's `rm_type`, else the config's); None when
        that reward cannot run in a worker (`poolable`)."""
        spec = sample.metadata.get("rm_type") or self.cfg.rm_type
        return (sample.response, sample.label, spec, sample.prompt, index) if poolable(spec) else None

    def _submit(self, sample: Sample, index: int) -> Future | None:
        """Score `sample` in the pool now; None when its reward cannot run in a worker."""
        record = self._record(sample, index)
        return None if record is None else self.reward_pool.submit([record])

    def _rewards(self, pairs: list[tuple[Sample, Future | None]]) -> list[float]:
        """One reward per sample, in order: the early ones' futures, the rest scored now (spread over the pool's
        workers where their reward can run there, else inline)."""
        c = self.cfg
        flat = [s for s, _ in pairs]
        if self.reward_pool is None:
            return score_batch(flat, rm_type=c.rm_type, timeout=c.reward_timeout)
        rewards: list[float | None] = [None] * len(flat)
        late = [i for i, (s, future) in enumerate(pairs) if future is None]
        records = {i: r for i in late if (r := self._record(flat[i], i)) is not None}
        for i, r in zip(records, self.reward_pool.map(list(records.values()))):
            rewards[i] = r
        inline = [i for i in late if rewards[i] is None]
        if inline:
            for i, r in zip(inline, score_batch([flat[i] for i in inline], rm_type=c.rm_type,
                                                timeout=c.reward_timeout, indices=inline)):
                rewards[i] = r
        for i, (_, future) in enumerate(pairs):
            if future is not None:
                rewards[i] = future.result()[0]
        return rewards

    def _renumber(self, groups: list[list[Sample]]) -> None:
        """Give kept groups consecutive run-global group ids and samples consecutive indices."""
        for group in groups:
            for s in group:
                s.group_index, s.index = self.next_group, self.next_index
                self.next_index += 1
            self.next_group += 1

    def evaluate(self, items: Sequence, cfg) -> dict[str, float]:
        """Mean reward, unbiased pass@k, response lengths and truncation on held-out prompt items.

        Args:
            items: `PromptItem`s with `prompt_token_ids`.
            cfg: `EvalConfig` (samples per prompt, temperature, pass_k, seed).

        Returns:
            `eval/reward`, `eval/pass@{k}`, `eval/response_len/*`, `eval/truncated_ratio`, `perf/eval_time`.
        """
        start = time.perf_counter()
        n = cfg.n_samples_per_prompt
        temperature = self.cfg.temperature if cfg.temperature is None else cfg.temperature
        seeds = prompt_seeds(cfg.seed, 0, 0, len(items), n)
        groups = self._sample_groups(items, n, seeds, temperature=temperature, max_new_tokens=cfg.max_response_len)
        samples = [s for g in groups for s in g]
        correct = [sum(s.reward >= 1.0 for s in g) for g in groups]
        out = {"eval/reward": float(np.mean([s.reward for s in samples]))}
        for k in cfg.pass_k:
            out[f"eval/pass@{k}"] = float(np.mean([pass_at_k(n, c, k) for c in correct]))
        out |= summarize([s.response_length for s in samples], "eval/response_len")
        out["eval/truncated_ratio"] = float(np.mean([s.status == Status.TRUNCATED for s in samples]))
        out["perf/eval_time"] = time.perf_counter() - start
        return out

    def state_dict(self) -> dict:
        """Sample-id counters (the dataset position is saved by its owner)."""
        return {"next_group": self.next_group, "next_index": self.next_index}

    def load_state_dict(self, state: dict) -> None:
        self.next_group, self.next_index = int(state["next_group"]), int(state["next_index"])


def rollout_metrics(samples: list[Sample], all_groups: list[list[Sample]]) -> dict[str, float]:
    """slime's rollout/* metrics: raw reward and lengths of the kept samples, zero-std counts of every group."""
    lengths = [sum(s.loss_mask) for s in samples]  # effective response length
    out = {"rollout/raw_reward": float(np.mean([s.reward for s in samples]))}
    out |= summarize(lengths, "rollout/response_len")
    out["rollout/truncated_ratio"] = float(np.mean([s.status == Status.TRUNCATED for s in samples]))
    zero_std = Counter(g[0].reward for g in all_groups if _equal_rewards(g))
    for reward, count in sorted(zero_std.items()):
        out[f"rollout/zero_std/count_{reward:g}"] = float(count)
    out["rollout/zero_std/count"] = float(sum(zero_std.values()))
    out["rollout/weight_version"] = float(min(s.weight_version for s in samples))
    return out


def _equal_rewards(group: list[Sample]) -> bool:
    """True when every reward in the group is the same (its group-normalised advantages are all 0)."""
    return len({s.reward for s in group}) == 1


def prompt_seeds(base: int, rollout_id: int, round_: int, n_prompts: int, n: int) -> list[int]:
    """One seed per prompt, a pure function of (base, rollout, round); sample j adds j (see expand_seeds)."""
    rng = np.random.default_rng([base, rollout_id, round_])
    return (rng.integers(0, 2**31 - n - 1, size=n_prompts)).tolist()
