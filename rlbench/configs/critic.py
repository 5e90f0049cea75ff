"""The PPO critic (slime's `--critic-*` flags): a value model trained beside the actor on the same ranks.

`TrainConfig.critic` holds it: the FSDP backend builds the critic with the actor (same mesh, precision and
kernels; its own optimizer and LR schedule), computes values over the same packs, checkpoints it inside the
actor's checkpoint and parks it with the actor between colocated turns. `advantage_estimator="gae"` needs one
(`RunConfig` adds the default when none is set, as slime's `--advantage-estimator ppo` does).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CriticConfig:
    """The value model and its training (field names follow slime's flags: `--critic-lr` -> `lr`); its loss
    is `LossConfig`'s (`value_clip`, and the policy loss's aggregation)."""

    load: str | None = None
    """`--critic-load`: a Hugging Face directory the critic starts from, a causal LM (its LM head is dropped, the
    value head initialised) or a saved critic (`score.*` tensors, loaded); None: the actor's `backend.model`."""
    lr: float | None = None
    """`--critic-lr`: peak learning rate of the critic; None: the actor's `optim.lr`."""
    lr_warmup_iters: int = 0
    """`--critic-lr-warmup-iters`: linear warmup of the critic's LR over this many of its optimizer steps (the
    rest of its schedule is the actor's `optim`: decay style, betas, weight decay, grad clip)."""
    num_critic_only_steps: int = 0
    """`--num-critic-only-steps`: the first N rollouts train only the critic (the actor's weights stay as they
    are, so its values settle before they steer the policy)."""

    def __post_init__(self) -> None:
        if self.lr is not None and self.lr < 0:
            raise ValueError(f"critic lr={self.lr} must be >= 0 (None: the actor's lr)")
        if self.lr_warmup_iters < 0:
            raise ValueError(f"critic lr_warmup_iters={self.lr_warmup_iters} must be >= 0")
        if self.num_critic_only_steps < 0:
            raise ValueError(f"num_critic_only_steps={self.num_critic_only_steps} must be >= 0")
