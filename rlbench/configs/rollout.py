"""Sampling, group size, dynamic sampling and rewards (`RolloutConfig`); held-out evaluation (`EvalConfig`)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from rlbench.configs.checks import did_you_mean, is_import_path
from rlbench.configs.multiturn import MultiTurnConfig

REWARD_NAMES = ("math", "exact", "countdown")
"""The built-in names of `rlbench.rewards.REWARDS`, so that a config checks `rm_type` without importing it
(tests/test_registries.py ties the two)."""


RM_NAME = "rm"
"""The reward model's name in `RolloutConfig.reward_weights`."""


def check_rm_type(rm_type) -> None:
    """Check a reward name without importing anything: a registry name, or `"module.path:function"`."""
    if callable(rm_type):
        return
    if isinstance(rm_type, str) and rm_type.startswith(f"{RM_NAME}:"):
        raise ValueError(f"rm_type={rm_type!r}: a reward model is not a rule reward; give its directory as "
                         f"reward_model (--reward-model {rm_type[len(RM_NAME) + 1:] or 'DIR'}) and weigh it with "
                         "reward_weights (--reward-weights math:1,rm:0.5)")
    if not isinstance(rm_type, str):
        raise ValueError(f"rm_type={rm_type!r} must be a registry name, 'module.path:function' or a callable")
    rewards = sys.modules.get("rlbench.rewards")  # once loaded, its registry (names registered at run time too)
    names = list(rewards.REWARDS) if rewards is not None else list(REWARD_NAMES)
    if rm_type in names:
        return
    if ":" not in rm_type:
        raise ValueError(
            f"unknown reward {rm_type!r} (rm_type){did_you_mean(rm_type, names)}; choose one of "
            f"{sorted(names)} or pass 'module.path:function'"
        )
    module_name, _, attr = rm_type.partition(":")
    if not (all(p.isidentifier() for p in module_name.split(".")) and attr.isidentifier()):
        raise ValueError(
            f"rm_type={rm_type!r} is not 'module.path:function' (e.g. 'my_pkg.rewards:score'); "
            f"or use a registry name: {sorted(names)}"
        )


def parse_reward_weights(text: str) -> dict[str, float]:
    """`"math:1,rm:0.5"` (or a JSON object) -> `{"math": 1.0, "rm": 0.5}`; a "module:function" name keeps its colon
    (the weight is after the last one)."""
    text = text.strip()
    if text.startswith("{"):
        import json

        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"reward_weights {text!r} is not a JSON object ({exc.msg}); write name:weight,...") from None
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, weight = part.rpartition(":")
        try:
            out[name.strip()] = float(weight)
        except ValueError:
            sep = ""
        if not sep or not name.strip():
            raise ValueError(f"reward_weights {text!r}: {part!r} is not name:weight; write e.g. math:1,rm:0.5")
    return out


def check_reward_weights(weights) -> dict[str, float]:
    """The weights as `{name: float}`, each name "rm" or a rule reward (`check_rm_type`), each weight finite."""
    import math

    if not isinstance(weights, dict) or not weights:
        raise ValueError(f"reward_weights={weights!r} must be a non-empty dict name -> weight (e.g. math:1,rm:0.5)")
    out = {}
    for name, weight in weights.items():
        if name != RM_NAME:
            try:
                check_rm_type(name)
            except ValueError as exc:
                raise ValueError(f"reward_weights name {name!r}: {exc}") from None
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight):
            raise ValueError(f"reward_weights[{name!r}]={weight!r} must be a finite number")
        out[name] = float(weight)
    return out


@dataclass
class RolloutConfig:
    """How prompts become scored samples: sampling, group size, dynamic sampling, truncation."""

    rollout_batch_size: int = 8
    """Prompts (groups) per rollout (slime's --rollout-batch-size)."""
    n_samples_per_prompt: int = 4
    """Responses sampled per prompt: the GRPO group size."""
    max_response_len: int = 32
    """Maximum new tokens per response (slime's --rollout-max-response-len)."""
    temperature: float = 1.0
    """Sampling temperature; log-probs and entropy in training use the same one."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1 = off)."""
    top_k: int = 0
    """Top-k sampling (0 = off)."""
    rm_type: str = "math"
    """Reward function name in `rlbench.rewards.REWARDS` or "module:function" (per-row metadata wins).
    Checked when the config is built (names, with "did you mean"); the import is resolved when the Trainer starts."""
    reward_timeout: float | None = 30.0
    """Seconds one reward call may take before `RewardError` names the function and the sample (calls run
    in a daemon worker thread; a stuck call's thread is abandoned). None or 0: no limit, calls run inline."""
    reward_workers: int | None = None
    """Processes that score rewards while the engine generates: each sample goes to a worker as soon as it
    stops, and the rollout waits only for those still scoring at the end (`rlbench.rollout.reward_pool`).
    None: half the cores (at most 8) on a GPU run, 0 on a CPU run; 0: inline, after generation. Rewards a worker
    cannot import by name (registered at run time, `__main__:fn`) are scored inline either way."""
    reward_model: str | None = None
    """A reward-model directory (`rlbench rm --out DIR`: HF model + scalar head) that scores every (prompt,
    response) after generation; its score is logged as rollout/rm_score, the rm_type reward beside it as
    rollout/rule_reward. None: rule rewards only."""
    reward_weights: dict[str, float] | None = None
    """The training reward as a weighted sum, name -> weight: rule rewards by name (as rm_type) and "rm" (the
    reward model's score), e.g. {"math": 1, "rm": 0.5} (--reward-weights math:1,rm:0.5). None: the rm_type reward
    alone, or the reward model's score alone when reward_model is set. Evaluation always uses rm_type."""
    reward_model_device: str | None = None
    """Where the reward model scores: None: the rollout engine's device (on a GPU its weights are copied there
    only while it scores); "cpu" keeps it off the GPU."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal (zero advantage) and sample more prompts to refill."""
    over_sampling_batch_size: int | None = None
    """Prompts pulled per refill round when dynamic sampling (None: rollout_batch_size)."""
    max_sampling_rounds: int = 8
    """Give up refilling after this many generate rounds and keep the groups found so far."""
    mask_truncated: bool = False
    """Zero the loss mask of responses cut at max_response_len (they still count in normalisation)."""
    ignore_eos: bool = False
    """Never stop at the eos token: every response is max_response_len tokens (benchmarks: the same work per sample)."""
    seed: int = 0
    """Base sampling seed: rollout r, prompt i, sample j use a seed derived from (seed, r, i, j)."""
    custom_generate_function_path: str | None = None
    """"module.path:function" that turns a round's prompts into sample groups (slime's flag;
    `rlbench.rollout.generate.GenerateFn`), e.g. "rlbench.rollout.multiturn:generate" for tool calling; None:
    single-turn generation. Imported when the rollout manager is built."""
    multiturn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Tools, turns and budgets of the multi-turn generate function (ignored by single-turn generation)."""

    def __post_init__(self) -> None:
        for name in ("rollout_batch_size", "n_samples_per_prompt", "max_response_len", "max_sampling_rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.{name}={getattr(self, name)} must be >= 1")
        if self.temperature <= 0:
            raise ValueError(f"rollout temperature={self.temperature} must be > 0 for RL (greedy has no log-probs)")
        obs = self.over_sampling_batch_size
        if obs is not None and obs < self.rollout_batch_size:
            raise ValueError(
                f"over_sampling_batch_size={obs} must be >= rollout_batch_size={self.rollout_batch_size} (or None)"
            )
        if self.dynamic_sampling and self.n_samples_per_prompt < 2:
            raise ValueError("dynamic_sampling needs n_samples_per_prompt >= 2 (a group of 1 always has equal rewards)")
        if self.reward_workers is not None and self.reward_workers < 0:
            raise ValueError(f"rollout.reward_workers={self.reward_workers} must be >= 0 (0: score inline; None: auto)")
        if self.reward_timeout is not None and self.reward_timeout < 0:
            raise ValueError(f"reward_timeout={self.reward_timeout} must be > 0 seconds (None or 0: no limit)")
        check_rm_type(self.rm_type)
        path = self.custom_generate_function_path
        if path is not None and not (isinstance(path, str) and is_import_path(path)):
            raise ValueError(f"custom_generate_function_path={path!r} is not 'module.path:function' (e.g. "
                             "'rlbench.rollout.multiturn:generate'); None generates single-turn")
        self._check_reward_mix()

    def _check_reward_mix(self) -> None:
        if isinstance(self.reward_weights, str):
            self.reward_weights = parse_reward_weights(self.reward_weights)
        if self.reward_weights is not None:
            self.reward_weights = check_reward_weights(self.reward_weights)
            if RM_NAME in self.reward_weights and self.reward_model is None:
                raise ValueError(f"reward_weights={self.reward_weights} weighs 'rm' but no reward_model is set; "
                                 "give its directory (--reward-model DIR) or drop 'rm'")
            if self.reward_model is not None and RM_NAME not in self.reward_weights:
                raise ValueError(f"reward_model={self.reward_model!r} is set but reward_weights={self.reward_weights} "
                                 "has no 'rm' term; add one (e.g. rm:0.5) or drop the reward model")
        if self.reward_model is not None and not (isinstance(self.reward_model, str) and self.reward_model):
            raise ValueError(f"reward_model={self.reward_model!r} must be a directory path or None")
        dev = self.reward_model_device
        if dev is not None and not (dev == "cpu" or dev == "cuda" or (dev.startswith("cuda:") and dev[5:].isdigit())):
            raise ValueError(f"reward_model_device={dev!r} must be None (the engine's device), 'cpu', 'cuda' or 'cuda:N'")

    @property
    def reward_mix(self) -> dict[str, float] | None:
        """The weights the training reward is summed with; None: the rm_type reward as it is (no mixing)."""
        if self.reward_weights is not None:
            return dict(self.reward_weights)
        return {RM_NAME: 1.0} if self.reward_model is not None else None

    @property
    def prompts_per_round(self) -> int:
        """Prompts one generate round pulls: the over-sampling batch under dynamic sampling, else the rollout's."""
        return (self.over_sampling_batch_size or self.rollout_batch_size) if self.dynamic_sampling else self.rollout_batch_size


@dataclass
class EvalConfig:
    """Held-out evaluation: mean reward and unbiased pass@k."""

    interval: int | None = None
    """Evaluate every this many rollouts (and before training); None: never."""
    data_path: str | None = None
    """Held-out prompts (.jsonl/.parquet, same keys as the training data); None: the task's eval split."""
    max_prompts: int | None = None
    """Use at most this many eval prompts (None: all)."""
    n_samples_per_prompt: int = 1
    """Samples per eval prompt (pass@k needs k <= this)."""
    temperature: float | None = None
    """Eval sampling temperature (None: the rollout temperature)."""
    max_response_len: int | None = None
    """Eval max new tokens (None: the rollout's)."""
    pass_k: tuple[int, ...] = (1,)
    """The k values reported as eval/pass@k."""
    skip_before_train: bool = False
    """Do not evaluate at rollout 0 before training."""
    seed: int = 12345
    """Eval sampling seed (fixed, so every eval sees the same random draws)."""

    def __post_init__(self) -> None:
        self.pass_k = tuple(self.pass_k)
        if self.interval is not None and self.interval < 1:
            raise ValueError(f"eval interval={self.interval} must be >= 1 or None (off)")
        if self.n_samples_per_prompt < 1:
            raise ValueError(f"eval n_samples_per_prompt={self.n_samples_per_prompt} must be >= 1")
        bad = [k for k in self.pass_k if not 1 <= k <= self.n_samples_per_prompt]
        if bad:
            raise ValueError(
                f"eval pass_k={self.pass_k} has k={bad} outside [1, n_samples_per_prompt={self.n_samples_per_prompt}]; "
                "raise n_samples_per_prompt or drop those k"
            )
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"eval temperature={self.temperature} must be >= 0 (0 = greedy)")
