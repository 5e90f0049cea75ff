"""Typed configs for the RL algorithms; field names follow slime's flags (`--eps-clip` -> `eps_clip`)."""

from __future__ import annotations

from dataclasses import dataclass

AGGREGATIONS = ("sample_mean", "token_mean", "seq_sum_constant")
"""Loss aggregation modes (`rlbench.algorithms.aggregation` implements them)."""
KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
"""KL estimators (`rlbench.algorithms.kl` implements them)."""
ADVANTAGE_ESTIMATORS = (
    "grpo",
    "gspo",
    "dr_grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "gae",
)
POLICY_LOSSES = ("ppo", "gspo", "cispo")
KL_CTL_TYPES = ("fixed", "adaptive")
"""KL-in-reward coefficient controllers (`rlbench.algorithms.kl_control` implements them)."""
MIS_LEVELS = ("token", "sequence", "geometric")
MIS_MODES = ("truncate", "clip", "mask")


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {choices}")


@dataclass
class MISConfig:
    """Masked importance sampling (slime's `examples/train_infer_mismatch_helper/mis.yaml`, same defaults)."""

    use_tis: bool = True
    """Multiply the policy loss by the (bounded) importance weight π_old/π_rollout."""
    use_rs: bool = True
    """Rejection sampling: zero the weight of tokens/sequences whose ratio leaves [rs_lower, rs_upper]."""
    tis_level: str = "token"
    """Ratio level of the IS weight: token | sequence (Π over the sequence) | geometric (mean log-ratio)."""
    rs_level: str = "token"
    """Ratio level of rejection sampling: token | sequence | geometric."""
    tis_mode: str = "truncate"
    """truncate: min(w, U); clip: clamp(w, L, U); mask: w, and tokens outside [L, U] are rejected."""
    tis_lower_bound: float | None = 0.5
    """L; None means 1 / tis_upper_bound."""
    tis_upper_bound: float = 2.0
    """U."""
    rs_lower_bound: float | None = None
    """Rejection lower bound; None means the (resolved) tis_lower_bound."""
    rs_upper_bound: float | None = None
    """Rejection upper bound; None means tis_upper_bound."""
    rs_veto_threshold: float | None = 1e-4
    """Reject a whole sequence if any trained token has π_old/π_rollout below this; None disables."""
    tis_batch_normalize: bool = True
    """Divide the weights by their mean over the WHOLE global batch (token or sequence level)."""

    def __post_init__(self) -> None:
        _choice("mis.tis_level", self.tis_level, MIS_LEVELS)
        _choice("mis.rs_level", self.rs_level, MIS_LEVELS)
        _choice("mis.tis_mode", self.tis_mode, MIS_MODES)
        if self.tis_lower_bound is None:
            self.tis_lower_bound = 1.0 / self.tis_upper_bound
        if self.rs_lower_bound is None:
            self.rs_lower_bound = self.tis_lower_bound
        if self.rs_upper_bound is None:
            self.rs_upper_bound = self.tis_upper_bound
        if not 0 <= self.tis_lower_bound <= self.tis_upper_bound:
            raise ValueError(
                f"mis bounds tis_lower_bound={self.tis_lower_bound}, tis_upper_bound={self.tis_upper_bound} "
                "must satisfy 0 <= lower <= upper"
            )
        if not 0 <= self.rs_lower_bound <= self.rs_upper_bound:
            raise ValueError(
                f"mis bounds rs_lower_bound={self.rs_lower_bound}, rs_upper_bound={self.rs_upper_bound} "
                "must satisfy 0 <= lower <= upper"
            )
        if self.rs_veto_threshold is not None and self.rs_veto_threshold <= 0:
            raise ValueError(f"mis.rs_veto_threshold={self.rs_veto_threshold} must be > 0 or None (off)")
        if self.tis_batch_normalize and self.use_tis and self.tis_level == "geometric":
            raise ValueError("mis.tis_batch_normalize=True is undefined for tis_level='geometric'; set it False")


@dataclass
class LossConfig:
    """Advantage estimator, policy loss, KL, entropy, aggregation and train–inference mismatch correction."""

    advantage_estimator: str = "grpo"
    """grpo | gspo | dr_grpo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline | gae (PPO with a critic:
    the run trains a value model, `TrainConfig.critic`)."""
    grpo_std_normalization: bool = True
    """GRPO/GSPO: divide by the group's unbiased std + 1e-6 (slime: --disable-grpo-std-normalization)."""
    normalize_advantages: bool = False
    """Whiten advantages over the global batch (masked mean/std); required by REINFORCE++(-baseline)."""
    gamma: float = 1.0
    """Discount for REINFORCE++ returns and GAE."""
    lambd: float = 1.0
    """GAE λ."""
    policy_loss: str | None = None
    """ppo | gspo | cispo; None: gspo when advantage_estimator == 'gspo', else ppo."""
    eps_clip: float = 0.2
    """Lower clip ε_low: ratios below 1 − ε_low are clipped. ppo/gspo: in [0, 1). cispo: any value >= 0, and
    >= 1 means no lower bound (slime's convention; MiniMax-M1's CISPO tunes only ε_high, e.g.
    `eps_clip=1.0, eps_clip_high=0.28`)."""
    eps_clip_high: float | None = None
    """Upper clip ε_high (DAPO clip-higher, e.g. 0.28); None means eps_clip."""
    eps_clip_c: float | None = None
    """Dual-clip constant c > 1: for A < 0 the loss is capped at −c·A; None disables."""
    use_kl_loss: bool = False
    """Add kl_loss_coef · KL(π‖π_ref) to the loss (needs ref log-probs)."""
    kl_loss_coef: float = 0.0
    """Coefficient of the KL loss term."""
    kl_loss_type: str = "k1"
    """KL estimator for the loss term (and for reward shaping): k1 | k2 | k3 | low_var_kl."""
    use_unbiased_kl: bool = False
    """Multiply the KL estimate by exp(logπ − logπ_old) (DeepSeek-V3.2 unbiased KL)."""
    kl_coef: float = 0.0
    """KL reward shaping (REINFORCE++, REINFORCE++-baseline, PPO); cannot be combined with kl_loss_coef."""
    kl_ctl_type: str = "fixed"
    """The kl_coef of KL-in-reward: fixed, or adaptive (Ziegler et al.: steered towards kl_target)."""
    kl_target: float | None = None
    """adaptive: the per-sample mean KL(π_old‖π_ref) β is steered towards (verl's default 0.1); needed then."""
    kl_horizon: float = 10000.0
    """adaptive: β changes by at most a factor 1 ± 0.2·n/kl_horizon after a step of n samples (verl: 10000)."""
    value_clip: float | None = 0.2
    """PPO critic: clip the new value to V_old ± value_clip in the value loss (slime's --value-clip, same
    default); None: the unclipped loss ½(V − G)²."""
    entropy_coef: float = 0.0
    """Entropy bonus: loss −= entropy_coef · H."""
    loss_aggregation: str = "sample_mean"
    """sample_mean | token_mean | seq_sum_constant (Dr.GRPO)."""
    loss_aggregation_constant: float | None = None
    """The per-sample divisor of seq_sum_constant (e.g. max response length); required for that mode."""
    use_rollout_logprobs: bool = False
    """Bypass mode: the rollout engine's log-probs are π_old (no recompute forward)."""
    use_tis: bool = False
    """Decoupled mode: importance-weight the loss by π_old/π_rollout (vanilla TIS, or MIS if `mis` set)."""
    tis_clip: float = 2.0
    """Vanilla TIS upper bound C."""
    tis_clip_low: float = 0.0
    """Vanilla TIS lower bound."""
    mis: MISConfig | None = None
    """Masked importance sampling config; replaces vanilla TIS (requires use_tis=True)."""
    use_opsm: bool = False
    """Off-policy sequence masking (DeepSeek-V3.2): drop A<0 sequences whose mean(old − new) > opsm_delta."""
    opsm_delta: float = 1e-4
    """OPSM threshold δ."""

    def __post_init__(self) -> None:
        if self.advantage_estimator == "ppo":  # slime's name; "ppo" here is the clipped policy loss (policy_loss)
            raise ValueError("advantage_estimator='ppo' is called 'gae' in rlbench (PPO's critic-based advantages; "
                             "'ppo' names the clipped policy loss, policy_loss='ppo'): use advantage_estimator='gae'")
        _choice("advantage_estimator", self.advantage_estimator, ADVANTAGE_ESTIMATORS)
        if self.policy_loss is None:
            self.policy_loss = "gspo" if self.advantage_estimator == "gspo" else "ppo"
        _choice("policy_loss", self.policy_loss, POLICY_LOSSES)
        _choice("kl_loss_type", self.kl_loss_type, KL_TYPES)
        _choice("loss_aggregation", self.loss_aggregation, AGGREGATIONS)
        _choice("kl_ctl_type", self.kl_ctl_type, KL_CTL_TYPES)
        if self.eps_clip_high is None:
            self.eps_clip_high = self.eps_clip
        self._validate_numbers()
        self._validate_combinations()

    def _validate_numbers(self) -> None:
        if self.policy_loss == "cispo":
            if not self.eps_clip >= 0:
                raise ValueError(f"eps_clip={self.eps_clip} must be >= 0 (cispo; >= 1 disables the lower bound)")
        elif not 0 <= self.eps_clip < 1:
            raise ValueError(
                f"eps_clip={self.eps_clip} must be in [0, 1) for policy_loss={self.policy_loss!r} "
                "(only cispo may drop the lower clip, with eps_clip >= 1)"
            )
        if self.eps_clip_high < 0:
            raise ValueError(f"eps_clip_high={self.eps_clip_high} must be >= 0")
        if self.eps_clip_c is not None and self.eps_clip_c <= 1:
            raise ValueError(f"eps_clip_c={self.eps_clip_c} must be > 1 (dual clip), or None to disable")
        if not (0 <= self.gamma <= 1 and 0 <= self.lambd <= 1):
            raise ValueError(f"gamma={self.gamma}, lambd={self.lambd} must be in [0, 1]")
        if self.value_clip is not None and not self.value_clip > 0:
            raise ValueError(f"value_clip={self.value_clip} must be > 0, or None for the unclipped value loss")
        if not 0 <= self.tis_clip_low <= self.tis_clip:
            raise ValueError(f"tis_clip_low={self.tis_clip_low}, tis_clip={self.tis_clip}: need 0 <= low <= clip")
        if self.kl_loss_coef < 0 or self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError(
                f"kl_loss_coef={self.kl_loss_coef}, kl_coef={self.kl_coef}, entropy_coef={self.entropy_coef} "
                "must be >= 0"
            )

    def _validate_combinations(self) -> None:
        if self.kl_coef != 0 and self.kl_loss_coef != 0:
            raise ValueError(
                f"kl_coef={self.kl_coef} (reward shaping) and kl_loss_coef={self.kl_loss_coef} (loss term) "
                "cannot both be non-zero; pick one"
            )
        if self.kl_coef != 0 and self.advantage_estimator in ("grpo", "gspo", "dr_grpo", "rloo"):
            raise ValueError(
                f"kl_coef={self.kl_coef} has no effect with advantage_estimator={self.advantage_estimator!r}; "
                "use use_kl_loss/kl_loss_coef or a REINFORCE++/PPO estimator"
            )
        if self.advantage_estimator.startswith("reinforce_plus_plus") and not self.normalize_advantages:
            raise ValueError(f"advantage_estimator={self.advantage_estimator!r} requires normalize_advantages=True")
        if self.kl_ctl_type == "adaptive" and not (self.kl_coef > 0 and (self.kl_target or 0) > 0):
            raise ValueError(
                f"kl_ctl_type='adaptive' needs kl_coef > 0 (its starting value, got {self.kl_coef}) and "
                f"kl_target > 0 (got {self.kl_target}), e.g. kl_coef=0.05, kl_target=0.1"
            )
        if self.kl_ctl_type == "fixed" and self.kl_target is not None:
            raise ValueError(f"kl_target={self.kl_target} has no effect with kl_ctl_type='fixed'; "
                             "set kl_ctl_type='adaptive' or leave kl_target unset")
        if not self.kl_horizon > 0:
            raise ValueError(f"kl_horizon={self.kl_horizon} must be > 0 (samples, e.g. 10000)")
        if self.use_rollout_logprobs and self.use_tis:
            raise ValueError(
                "use_rollout_logprobs=True (bypass: old = rollout) and use_tis=True (decoupled) are exclusive"
            )
        if self.mis is not None and not self.use_tis:
            raise ValueError("mis is set but use_tis=False; set use_tis=True to enable masked IS")
        if self.loss_aggregation == "seq_sum_constant" and not self.loss_aggregation_constant:
            raise ValueError(
                "loss_aggregation='seq_sum_constant' needs loss_aggregation_constant (e.g. max response length)"
            )

    @property
    def needs_critic(self) -> bool:
        """Whether the advantages read a critic's values (GAE): the run trains a value model."""
        return self.advantage_estimator == "gae"

    @property
    def needs_ref(self) -> bool:
        """Whether a reference model's log-probs are needed."""
        return self.use_kl_loss or self.kl_coef != 0

    @property
    def mode(self) -> str:
        """standard (old = recompute) | bypass (old = rollout) | decoupled (recompute + IS on old/rollout)."""
        if self.use_rollout_logprobs:
            return "bypass"
        return "decoupled" if self.use_tis else "standard"
