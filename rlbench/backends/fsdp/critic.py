"""The PPO critic on the FSDP backend: a value model built, trained and checkpointed by the actor's code.

    backend = FSDPActorCritic(cfg)          # cfg.critic set (build_backend picks this class from the config)
    backend.init()                          # actor (+ ref) and the critic, on the same mesh
    values = backend.compute_values(packs)  # [R] per pack: V of each response token's state, no grad
    metrics = backend.train_critic(packs, inputs, value_loss_fn)   # one critic optimizer step: critic/*

`FSDPCritic` is an `FSDPBackend` whose model is a value model (`build_sharded_model(value_head=True)`: the decoder
with a Linear(hidden, 1) head over the last hidden state, transformers' token-classification layout, the reward
model's too: `rlbench.models.value_head`) and whose
`forward_pack` returns values instead of log-probs; everything else (sharding, compile, the packed forward's
inputs, gradient accumulation with the global-sum loss, clipping, the skipped non-finite step, interrupt safety) is
the actor's. The value of response token t is read at the position that predicts it (`Pack.response_index`, where
the log-prob of t is read): V of the state before t is generated.

`FSDPActorCritic` is the TrainBackend of a run with a critic: the actor backend that owns one `FSDPCritic` on its
mesh, as it owns the reference model. Its training state includes the critic's (`state_tensors`: the memory plan
counts it, `sleep` / `wake_up` park it with the actor's), and its checkpoints hold the critic in `critic/` of the
same atomic directory (`rlbench.backends.checkpoint`, `parts`), so a resume restores both or neither.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from rlbench.backends.base import LossFn
from rlbench.backends.fsdp.actor import FSDPBackend, reset_on_error
from rlbench.backends.fsdp.model import build_sharded_model
from rlbench.configs.backend import TrainConfig
from rlbench.distributed.mesh import DistEnv
from rlbench.models import load_tokenizer
from rlbench.models.value_head import token_values, write_stamp

CRITIC_DIR = "critic"
"""The critic's sub-directory inside each checkpoint."""


def critic_train_config(cfg: TrainConfig) -> TrainConfig:
    """The critic's backend config: the actor's mesh, precision, kernels and sharding, with the critic's model
    (`critic.load`, else the actor's) and optimizer (`TrainConfig.critic_optim`); no reference model, no entropy,
    the standard (not batch-invariant) kernels: values are not compared with any engine's."""
    if cfg.critic is None:
        raise ValueError("critic_train_config: TrainConfig.critic is None; set it (--critic-*, or "
                         "advantage_estimator='gae' in a RunConfig)")
    return dataclasses.replace(cfg, model=cfg.critic.load or cfg.model, ref_model=None, ref_update_interval=None,
                               optim=cfg.critic_optim, critic=None, with_entropy=False, batch_invariant=False,
                               checkpoint_dir=None)


class FSDPCritic(FSDPBackend):
    """The value model (see the module docstring); `env` is the actor's. `export_hf(path)` writes a value-model
    directory (`rlbench.models.value_head` layout, `kind: "critic"`), which `--critic-load` of a later run loads with
    its head."""

    def build_model(self):
        return build_sharded_model(self.cfg.model, self.cfg, self.env, offload=bool(self.cfg.fsdp.cpu_offload),
                                   value_head=True)

    def forward_pack(self, model, pack, with_entropy: bool) -> tuple[torch.Tensor, None]:
        """`(values [R] fp32, None)` of one packed micro-batch: the value head at the positions predicting the
        response tokens."""
        inputs, index = self.pack_inputs(pack)
        with warnings.catch_warnings():  # the head's [1, T, 1] output is a view; nothing here writes into it
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
            values = token_values(model, **inputs)[0]  # [T]
        return values[index], None

    def export_hf(self, path: str, dtype: torch.dtype | None = None) -> None:
        """The value-model layout: the HF directory, the tokenizer of the critic's starting directory when it has
        one (so `--reward-model` can score text with it), the version stamp."""
        super().export_hf(path, dtype=dtype)
        if self.env.is_main:
            src = self.cfg.model
            if os.path.isdir(src) and any(os.path.isfile(os.path.join(src, f))
                                          for f in ("tokenizer.json", "tokenizer_config.json")):
                load_tokenizer(src).save_pretrained(path)
            write_stamp(path, {"kind": "critic"})

    def compute_values(self, packs: Sequence[Any]) -> list[torch.Tensor]:
        """No-grad values `[R]` (fp32, CPU) of each pack, in the training forward's kernels (`_pass_grad_mode`), so a
        training step's first forward reproduces them bit for bit."""
        self._check_same_count(len(packs))
        out = []
        for pack in packs:
            with self._pass_grad_mode(), reset_on_error(self.model):
                values, _ = self.forward_pack(self.model, pack, False)
            out.append(values.detach().cpu())
        self.model.reshard()
        return out


class FSDPActorCritic(FSDPBackend):
    """The FSDP TrainBackend with a critic (`cfg.critic`): `FSDPBackend` plus `compute_values` / `train_critic`,
    the critic in `state_tensors`, `sleep` / `wake_up` and the checkpoints.

    Args: as `FSDPBackend`; `cfg.critic` must be set.
    """

    def __init__(self, cfg: TrainConfig, *, env: DistEnv | None = None, loss_fn: LossFn | None = None,
                 temperature: float = 1.0) -> None:
        super().__init__(cfg, env=env, loss_fn=loss_fn, temperature=temperature)
        self.critic = FSDPCritic(critic_train_config(cfg), temperature=temperature)

    def init(self) -> int:
        step = super().init()
        self.critic.env = self.env
        self.critic.init()
        return step

    def compute_values(self, packs: Sequence[Any]) -> list[torch.Tensor]:
        """The critic's values `[R]` of each pack (no grad; collective like `compute_log_prob`)."""
        self._check_awake()
        return self.critic.compute_values(packs)

    def train_critic(self, packs: Sequence[Any], loss_inputs: Sequence[Any], loss_fn: LossFn) -> dict:
        """One critic optimizer step over this rank's micro-batches, as `train` does the actor's:
        `loss_fn(values [R], None, loss_inputs[i]) -> (loss, metrics)` is a global-batch weighted sum. Returns
        `critic/{loss,grad_norm,lr,skipped,step}`, the loss's metrics as `critic/<name>`, `perf/critic_train_time`."""
        self._check_awake()
        metrics = self.critic.train(packs, loss_inputs, loss_fn)
        out = {f"critic/{k.removeprefix('train/')}": v for k, v in metrics.items() if k.startswith("train/")}
        return out | {"perf/critic_train_time": metrics["perf/train_time"]}

    def _check_awake(self) -> None:
        if self._parking.asleep:
            raise ValueError("the backend is asleep (its device memory is released); call wake_up() first")

    def checkpoint_parts(self) -> dict:
        return {CRITIC_DIR: (self.critic, self.critic.cfg.optim)}

    def state_tensors(self) -> list[torch.Tensor]:
        """The actor's training state and the critic's (parked together; the memory plan counts both)."""
        return super().state_tensors() + self.critic.state_tensors()

    def sleep(self) -> dict:
        if not self._parking.asleep:
            self.critic.model.reshard()  # registered params must be the sharded ones
        return super().sleep()
