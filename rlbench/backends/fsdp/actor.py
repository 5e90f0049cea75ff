"""The FSDP2 TrainBackend: packed forwards, global-batch-normalised gradient accumulation, AdamW.

One code path for every world size and device. Micro-batches are packs (`tokens [T]`,
`position_ids [T]`, `response_index [R]`); the model sees `input_ids [1, T]`, `position_ids [1, T]`,
`use_cache=False`, which makes transformers build the per-document causal mask from the position ids.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from rlbench.algorithms.logprobs import token_logprobs
from rlbench.backends.attention import packed_attention_mask
from rlbench.backends.base import LossFn, PackOutputs
from rlbench.backends.checkpoint import CommittedCheckpoints, load_checkpoint, save_checkpoint
from rlbench.backends.export import export_hf, named_weight_buckets
from rlbench.backends.fsdp.model import build_sharded_model, with_model_attention
from rlbench.backends.offload import Parking, state_tensors, to_device
from rlbench.backends.optim import build_optimizer, build_scheduler, init_optimizer_state
from rlbench.backends.vision import pack_vision_inputs
from rlbench.configs.backend import TrainConfig
from rlbench.distributed.mesh import DistEnv, barrier, init_distributed
from rlbench.host_memory import retain_freed_host_memory
from rlbench.interrupts import defer_sigint, raise_if_interrupted
from rlbench.models.capabilities import model_features
from rlbench.models.moe import has_moe, load_balancing_loss


class FSDPBackend(CommittedCheckpoints):
    """FSDP2 actor (+ optional CPU-offloaded reference model) implementing `TrainBackend`.

    Args:
        cfg: the backend's config.
        env: process groups and mesh (None: `init()` builds them from `cfg`).
        loss_fn: default `train()` loss.
        temperature: the sampling temperature (a run's `rollout.temperature`): log-probs and entropy are
            those of `softmax(logits / temperature)`.
    """

    def __init__(
        self, cfg: TrainConfig, *, env: DistEnv | None = None, loss_fn: LossFn | None = None, temperature: float = 1.0
    ):
        if temperature <= 0:
            raise ValueError(f"temperature={temperature} must be > 0 (log-probs use the sampling temperature)")
        self.cfg = cfg
        self.temperature = temperature
        self.env = env
        self.loss_fn = loss_fn
        self.step = 0  # optimizer steps taken (skipped steps do not count)
        self.model = self.ref = self.optimizer = self.scheduler = self.hf_config = None
        self._parking = Parking()
        self._cp_kernel = None  # `rlbench.distributed.cp_kernels.CPKernel` under CP, chosen at init
        self._features = None  # the model's architecture features (`models.capabilities`): its packed masks

    # ---------------------------------------------------------------- build
    def init(self) -> int:
        cfg = self.cfg
        if cfg.cp_size > 1:  # before any process group: a missing optional kernel package fails first
            from rlbench.distributed.cp_kernels import cp_kernel

            self._cp_kernel = cp_kernel(cfg.fsdp.cp_attention)
        if self.env is None:
            self.env = init_distributed(cfg.device, cp_size=cfg.cp_size, cpu_offload=bool(cfg.fsdp.cpu_offload))
        if self.env.device.type == "cpu":
            retain_freed_host_memory()  # the step's large temporaries reuse freed blocks (no page faults)
        if cfg.critic is not None and getattr(self, "critic", None) is None:
            raise ValueError("TrainConfig.critic is set: build the backend with a critic, "
                             "rlbench.backends.fsdp.critic.FSDPActorCritic (build_backend picks it from the config)")
        self.cfg = cfg = with_model_attention(cfg)
        torch.manual_seed(cfg.seed)
        self.model, self.hf_config = self.build_model()
        self._features = model_features(self.hf_config)
        _check_kv_head_chunk(cfg, self.hf_config)
        if cfg.fsdp.moe_aux_loss_coef > 0 and not has_moe(self.model):
            raise ValueError(f"moe_aux_loss_coef={cfg.fsdp.moe_aux_loss_coef} but {cfg.model!r} "
                             f"({self.hf_config.model_type}) has no MoE layers; set it to 0")
        if cfg.ref_model is not None:
            # Same precision policy and kernels as the actor, params streamed from CPU per layer.
            self.ref, _ = build_sharded_model(cfg.ref_model, cfg, self.env, offload=True)
            # compiled layers: the ref pass runs the actor's training graph (`_pass_grad_mode`), whose inputs
            # require grad; nothing ever steps or accumulates into the reference
            self.ref.requires_grad_(cfg.compiled)
        if cfg.batch_invariant:  # the engine's numerics (true on-policy mode), checked on this machine first
            from rlbench import numerics

            numerics.self_test(self.env.device, cfg.torch_param_dtype, compiled=cfg.compiled)
            for net in (self.model, self.ref):
                if net is not None:
                    numerics.make_batch_invariant(net)
        fused = self.env.device.type == "cuda" and not cfg.fsdp.cpu_offload
        self.optimizer = build_optimizer(self.model.parameters(), cfg.optim, fused=fused)
        init_optimizer_state(self.optimizer)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim)
        self.step = 0
        return self.step

    def build_model(self):
        """`(model, hf_config)` of the trained model: the causal LM of `cfg.model` (the critic: a value model)."""
        return build_sharded_model(self.cfg.model, self.cfg, self.env, offload=bool(self.cfg.fsdp.cpu_offload))

    @property
    def pack_buckets(self) -> bool:
        """Whether packs should come in few bucketed lengths (`make_step_packs(bucket=True)`, RankStep reads it):
        the compiled decoder layers specialise on T (`rlbench.backends.fsdp.model`), one graph per length."""
        return self.cfg.compiled

    # ---------------------------------------------------------------- forward
    def forward_pack(self, model, pack, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Response-space `(logp [R], entropy [R] | None)` of one packed micro-batch."""
        if self._parking.asleep:
            raise ValueError("the backend is asleep (its device memory is released); call wake_up() first")
        if self.env.cp_size > 1:
            return self._forward_pack_cp(model, pack, with_entropy)
        inputs, index = self.pack_inputs(pack)
        tokens = inputs["input_ids"][0]  # [T]
        logits = kept_logits(model, index, **inputs)
        return token_logprobs(
            logits, tokens[index + 1], self.temperature, chunk_size=self.cfg.logprob_chunk_size,
            with_entropy=with_entropy, lse_fn=_engine_lse() if self.cfg.batch_invariant else None,
        )

    def _forward_train(self, pack, with_entropy: bool):
        """`forward_pack` of the training pass: `(logp [R], entropy [R] | None, aux)`, where aux is the MoE router
        load-balancing loss of the pack's real tokens when `fsdp.moe_aux_loss_coef > 0` (else None)."""
        if self.cfg.fsdp.moe_aux_loss_coef <= 0:
            return *self.forward_pack(self.model, pack, with_entropy), None
        inputs, index = self.pack_inputs(pack)
        tokens = inputs["input_ids"][0]  # [T]
        out = self.model(**inputs, use_cache=False, logits_to_keep=index, output_router_logits=True)
        real = torch.arange(pack.num_tokens, device=tokens.device) < pack.num_tokens - pack.pad_length  # [T]
        aux = load_balancing_loss(self.model, out.router_logits, real)
        logp, ent = token_logprobs(
            out.logits[0], tokens[index + 1], self.temperature, chunk_size=self.cfg.logprob_chunk_size,
            with_entropy=with_entropy, lse_fn=_engine_lse() if self.cfg.batch_invariant else None,
        )
        return logp, ent, aux

    def pack_inputs(self, pack) -> tuple[dict, torch.Tensor]:
        """`(model kwargs, response_index [R])` of one pack on the device: `input_ids [1, T]`, `position_ids [1, T]`,
        the attention mask (None: transformers builds the documents' mask from the position ids) and the forward's
        extras; `response_index` holds the positions predicting the response tokens."""
        if self._parking.asleep:
            raise ValueError("the backend is asleep (its device memory is released); call wake_up() first")
        dev = self.env.device
        tokens = to_device(pack.tokens, dev)  # [T]
        positions = to_device(pack.position_ids, dev)  # [T]
        mask = None
        if not self.cfg.batch_invariant:  # the batch-invariant attention reads the position ids (tiles)
            mask = packed_attention_mask(positions, self.cfg.attention, self._features, self.cfg.torch_param_dtype)
        index = to_device(pack.response_index, dev)  # [R] the positions predicting response tokens
        extra = {}
        if self.cfg.batch_invariant:  # tiles from the pack's host position ids: no device sync before the layers
            extra["rl_tiles"] = _forward_tiles(pack.position_ids[None], self.hf_config, dev)
        inputs = dict(input_ids=tokens[None], position_ids=positions[None], attention_mask=mask)
        if self._features.vision:  # M-RoPE rows after the text row, and the pack's images
            inputs |= pack_vision_inputs(self.model, pack, tokens, positions)
        return inputs | extra, index

    def _forward_pack_cp(self, model, pack, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward_pack` of one CP rank: the model sees the rank's slice; the result is the FULL `[R]`.

        The slicing is the kernel's (`cp_attention`): zig-zag for "allgather", contiguous for ring-flash-attn's
        llama3 kernel. Each rank scores the response tokens whose predicting position it holds
        (`cp_local_response`; the target is the full pack's token at global index + 1, so chunk borders are
        right), then `_cp_assemble` puts every rank's part into response order. Its backward hands each rank the
        gradient of its own entries only, so with the loss computed identically on every CP peer the parameter
        gradients summed over the peers are the full pack's, once.
        """
        from rlbench.packing.cp import cp_layout, cp_local_response, cp_slice, pad_for_cp

        env, dev, kernel = self.env, self.env.device, self._cp_kernel
        cp, rank = env.cp_size, env.cp_rank
        if not _laid_out_for_cp(pack, cp, kernel.zigzag):  # RankStep packs are aligned; others get re-laid out
            pack = pad_for_cp(pack, cp, zigzag=kernel.zigzag)
        layout = cp_layout(pack, cp, zigzag=kernel.zigzag)
        group = env.mesh["cp"].get_group()
        tokens = cp_slice(pack.tokens, layout, rank).to(dev, non_blocking=True)  # [T/cp]
        positions = cp_slice(pack.position_ids, layout, rank).to(dev, non_blocking=True)  # [T/cp]
        ctx = kernel.context(layout, rank, group, self.cfg.fsdp.cp_kv_head_chunk, self.cfg.fsdp.cp_recompute, dev)
        local_pos, resp_ids = cp_local_response(pack, layout, rank)  # [R_r]
        logits = kept_logits(model, local_pos.to(dev), input_ids=tokens[None], position_ids=positions[None], rl_cp=ctx)
        targets = pack.tokens[layout.indices[rank][local_pos] + 1].to(dev, non_blocking=True)  # [R_r]
        logp, ent = token_logprobs(
            logits, targets, self.temperature, chunk_size=self.cfg.logprob_chunk_size, with_entropy=with_entropy,
        )
        R = int(pack.response_index.numel())
        resp_ids = resp_ids.to(dev)
        return _cp_assemble(logp, resp_ids, R, group), (_cp_assemble(ent, resp_ids, R, group) if ent is not None else None)

    def _pass_grad_mode(self):
        """The grad mode of the log-prob passes: the training forward's graph where the kernels depend on it.

        A compiled layer gets one inductor graph with grad (the forward half of the training graph, which stores
        the activations backward needs) and another without (free to fuse across them), and the two round
        differently in bf16; a pass under grad runs the training forward's kernels, so old / ref log-probs are
        the bits the training forward computes (first-micro-batch PPO KL and ref KL with ref == actor exactly
        0). Outputs are detached at once, so the graph is freed after each micro-batch.
        """
        return torch.enable_grad() if self.cfg.compiled else torch.no_grad()

    def compute_log_prob(
        self, packs: Sequence[Any], *, model: str = "actor", with_entropy: bool = False
    ) -> list[PackOutputs]:
        if model not in ("actor", "ref"):
            raise ValueError(f"model={model!r}; use 'actor' or 'ref'")
        if model == "ref" and self.ref is None:
            raise ValueError("model='ref' but no reference model was configured (set TrainConfig.ref_model)")
        net = self.model if model == "actor" else self.ref
        self._check_same_count(len(packs))  # unequal counts would desynchronise the forwards' collectives
        outs = []
        for pack in packs:
            with self._pass_grad_mode(), reset_on_error(net):
                logp, ent = self.forward_pack(net, pack, with_entropy)
                logp, ent = logp.detach(), (ent.detach() if ent is not None else None)
            outs.append(PackOutputs(logp.cpu(), ent.cpu() if ent is not None else None, list(pack.response_lengths)))
        net.reshard()  # the root is kept gathered after forward (for backward); without backward, free it
        return outs

    # ---------------------------------------------------------------- train
    def train(self, packs: Sequence[Any], loss_inputs: Sequence[Any], loss_fn: LossFn | None = None) -> dict:
        """One optimizer step: accumulate over `packs`, sync grads once, clip, AdamW, schedule.

        The loss of each micro-batch must already carry global-batch weights (a weighted *sum*), so
        gradients are summed over micro-batches and ranks. A step whose loss or grad norm is not finite
        is skipped: no parameter, optimizer or scheduler change, `train/skipped = 1`. The loss's metrics
        (bare names, weighted sums) are summed over micro-batches and ranks and returned as `train/<name>`.

        Interrupt-safe (docs/reliability.md): gradients are cleared before the accumulation starts, so a
        call interrupted mid-accumulation (KeyboardInterrupt) leaks nothing into the next one; the update itself
        (optimizer, scheduler, `step`) runs with SIGINT deferred, so it is applied entirely or not at all.
        """
        loss_fn = loss_fn or self.loss_fn
        if loss_fn is None:
            raise ValueError("train() needs a loss_fn (pass one here or to FSDPBackend(loss_fn=...))")
        if len(packs) != len(loss_inputs):
            raise ValueError(f"{len(packs)} packs but {len(loss_inputs)} loss inputs; pass one per pack")
        self._check_same_count(len(packs))
        t0 = time.perf_counter()
        self.model.train()
        self._clear_grads()  # an interrupted earlier call may have left gradients (sharded and FSDP's unsharded)
        loss_sum, metric_sums = self._accumulate(packs, loss_inputs, loss_fn)
        keys = sorted(metric_sums)
        totals = torch.stack([loss_sum] + [metric_sums[k] for k in keys]).double()
        raise_if_interrupted()  # the last point before the update
        # CP peers compute the same loss and metrics (full [R] per pack): count them once, over the DP group
        dist.all_reduce(totals, group=self.env.mesh["dp"].get_group() if self.env.cp_size > 1 else None)
        grad_norm = self._clip_grad_norm()
        ok = bool(torch.isfinite(totals[0])) and bool(torch.isfinite(grad_norm))
        lr = self.scheduler.get_last_lr()[0]
        if ok:
            with defer_sigint():  # all of the update or none of it
                self.optimizer.step()
                self.scheduler.step()
                self.step += 1
        self.optimizer.zero_grad(set_to_none=True)
        metrics = {f"train/{k}": float(v) for k, v in zip(keys, totals[1:])}  # the loss's metrics are bare names
        metrics |= {
            "train/loss": float(totals[0]),
            "train/grad_norm": float(grad_norm),
            "train/lr": lr,
            "train/skipped": 0.0 if ok else 1.0,
            "train/step": float(self.step),
            "perf/train_time": time.perf_counter() - t0,
        }
        return metrics

    def _accumulate(self, packs, loss_inputs, loss_fn) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        # FSDP averages gradients over the shard group; the loss is a global weighted sum, so undo the mean.
        # For power-of-two worlds both `* scale` and FSDP's `/ scale` are exact: grads = the rank sums.
        # Under CP the peers compute the same (full-pack) loss, but each one's backward reaches only its own
        # tokens (`_cp_assemble`, `all_gather_kv`), so the sum over all dp x cp ranks is still the global
        # gradient once: the scale stays the shard-mesh size (tests/test_cp_train.py checks it against cp=1).
        scale = float(self.env.shard_mesh.size())
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.env.device)
        sums: dict[str, torch.Tensor] = {}
        for i, (pack, inputs) in enumerate(zip(packs, loss_inputs)):
            raise_if_interrupted()  # a held Ctrl-C stops here, between micro-batches (grads cleared next call)
            if self.cfg.fsdp.no_sync_accumulation:
                self.model.set_requires_gradient_sync(i == len(packs) - 1)
            with reset_on_error(self.model):  # a CUDA OOM or a Ctrl-C in a backward hook stops mid-pass
                logp, ent, aux = self._forward_train(pack, self.cfg.with_entropy)
                loss, metrics = loss_fn(logp, ent, to_device(inputs, self.env.device))
                if aux is not None:  # a mean over all micro-batches of all DP ranks (they run equally many)
                    aux = aux / (len(packs) * self.env.dp_size)
                    loss = loss + self.cfg.fsdp.moe_aux_loss_coef * aux
                    metrics = {**metrics, "moe_aux_loss": aux.detach()}
                (loss * scale).backward()
            loss_sum += loss.detach().double()
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0) + torch.as_tensor(v, device=self.env.device).detach().double()
        namespaced = sorted(k for k in sums if "/" in k)
        if namespaced:
            raise ValueError(f"loss_fn returned metric keys {namespaced}; return bare names (train() adds 'train/')")
        return loss_sum, sums

    @torch.no_grad()
    def update_ref(self) -> dict:
        """Copy the actor's weights into the reference model (slime's `--ref-update-interval`).

        Shard to shard: actor and reference are sharded over the same mesh with the same placements, so
        each rank copies its own local fp32 shards (no gather); the reference keeps its CPU-offloaded
        parameters. Afterwards `compute_log_prob(model="ref")` equals the actor's bit for bit.
        """
        if self.ref is None:
            raise ValueError("update_ref() needs a reference model; set TrainConfig.ref_model")
        if self._parking.asleep:
            raise ValueError("the backend is asleep (its device memory is released); call wake_up() first")
        t0 = time.perf_counter()
        self.model.reshard()  # registered params must be the sharded ones
        self.ref.reshard()
        actor, ref = dict(self.model.named_parameters()), dict(self.ref.named_parameters())
        mismatched = sorted(k for k in actor.keys() | ref.keys() if k not in actor or k not in ref
                            or actor[k].shape != ref[k].shape or actor[k].placements != ref[k].placements)
        if mismatched:
            raise ValueError(
                f"reference and actor parameters differ at {mismatched[:5]} (of {len(mismatched)}); "
                "update_ref needs ref_model of the actor's architecture"
            )
        for name, param in actor.items():
            ref[name].to_local().copy_(param.to_local())
        return {"perf/ref_update_time": time.perf_counter() - t0}

    def _clear_grads(self) -> None:
        """No gradient anywhere: the sharded `.grad`s and FSDP2's unsharded accumulators, which hold the
        micro-batches of an accumulation interrupted under `no_sync_accumulation` (the optimizer never sees
        them, but the next reduce-scatter would add them in)."""
        from torch.distributed.fsdp import FSDPModule

        reset_fsdp_iteration(self.model)  # idle and resharded, whatever an earlier failed pass left
        for module in self.model.modules():
            if not isinstance(module, FSDPModule):
                continue
            for group in _param_groups(module._get_fsdp_state()):
                for fsdp_param in group.fsdp_params:
                    fsdp_param.unsharded_accumulated_grad = None
                    unsharded = getattr(fsdp_param, "_unsharded_param", None)
                    if unsharded is not None:
                        unsharded.grad = None
        self.optimizer.zero_grad(set_to_none=True)

    def _clip_grad_norm(self) -> torch.Tensor:
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.cfg.optim.clip_grad or float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def _check_same_count(self, n: int) -> None:
        counts = torch.tensor([n, -n], device=self.env.device)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)
        if counts[0] != -counts[1]:
            raise ValueError(
                f"ranks have different micro-batch counts (min {-int(counts[1])}, max {int(counts[0])}); "
                "make_packs must use the DP-wide max count (num_micro_batches(reduce_max=..., seq_align=...) with the "
                "packs' slot alignment)"
            )

    # ---------------------------------------------------------------- state
    def _checkpoint_root(self) -> str:
        if not self.cfg.checkpoint_dir:
            raise ValueError("TrainConfig.checkpoint_dir is not set; set it to save or load checkpoints")
        return self.cfg.checkpoint_dir

    def save(self, step: int | None = None, extra: dict | None = None) -> str:
        """Atomic checkpoint `step` (default: the optimizer steps taken) under `cfg.checkpoint_dir`; `extra`
        (file name -> object) is written inside it by rank 0 and committed with it. Returns its directory."""
        step = self.step if step is None else step
        args = (self.model, self.optimizer, self.scheduler, self.env)
        parts = {name: part for name, (part, _) in self.checkpoint_parts().items()}
        return save_checkpoint(self._checkpoint_root(), step, *args, fmt=self.cfg.fsdp.checkpoint_format,
                               extra_meta=self.checkpoint_meta, extra=extra, parts=parts)

    @property
    def checkpoint_meta(self) -> dict:
        """What a checkpoint records of this model beside its state (checked on load: resume.py)."""
        return {"model": self.cfg.model, "model_overrides": dict(self.cfg.model_overrides),
                "optim_config": dataclasses.asdict(self.cfg.optim)}

    def load(self, step: int | None = None) -> int:
        root = self._checkpoint_root()
        parts = self.checkpoint_parts()
        self.step = load_checkpoint(root, self.model, self.optimizer, self.scheduler, self.env, step,
                                    optim_cfg=self.cfg.optim, parts=parts)
        return self.step

    def checkpoint_parts(self) -> dict:
        """Trained models checkpointed beside the actor, in sub-directories of its checkpoint: name ->
        (a `rlbench.backends.checkpoint.StatePart`, its `OptimConfig`); `load` sets each part's `step`. None here;
        the critic's backend has one."""
        return {}

    def export_hf(self, path: str, dtype: torch.dtype | None = None) -> None:
        """A plain HF directory of the current actor weights (from_pretrained loads it)."""
        export_hf(self.model, self.hf_config, path, self.env, dtype=dtype)

    def named_weights_for_sync(
        self, bucket_bytes: int = 512 << 20, dtype: torch.dtype | None = torch.bfloat16
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        return named_weight_buckets(self.model, bucket_bytes, dtype)

    # ---------------------------------------------------------------- memory
    def state_tensors(self) -> list[torch.Tensor]:
        """The device tensors of the training state (local parameter shards, grads, AdamW state): what sleep parks."""
        return state_tensors(self.model, self.optimizer)

    def sleep(self) -> dict:
        """Park params, grads and optimizer state in host memory; the device copies are freed."""
        if not self._parking.asleep:
            self.model.reshard()  # registered params must be the sharded ones
        return self._parking.park(self.state_tensors(), self.env.device, lambda: barrier(self.env))

    def wake_up(self) -> dict:
        return self._parking.unpark(lambda: barrier(self.env))


class _SumOverPeers(torch.autograd.Function):
    """all_reduce(SUM) over the CP group forward; identity backward. Every peer computes the same loss from the
    summed tensor, so each one's upstream gradient is already the full one: passing it through unchanged (not
    summed over peers) gives each rank exactly the gradient of the entries it contributed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _cp_assemble(local: torch.Tensor, resp_ids: torch.Tensor, num_response: int, group) -> torch.Tensor:
    """A CP rank's response values `[R_r]` at `resp_ids` -> the full `[R]` on every peer (the ranks' ids
    partition range(R), the others contribute exact zeros, so the sum is bit-exact)."""
    full = local.new_zeros(num_response).index_copy(0, resp_ids, local)
    return _SumOverPeers.apply(full, group)


def kept_logits(model, keep: torch.Tensor, **inputs) -> torch.Tensor:
    """Logits `[K, V]` of the positions `keep` `[K]` of a one-row training forward (`model(**inputs)`, no KV cache).

    The lm-head runs on those rows only (HF's `logits_to_keep`): prompt and pad positions predict nothing the loss
    uses. Its GEMM is row-local, so each row is the one the full `[T, V]` head would give.
    """
    logits = model(**inputs, use_cache=False, logits_to_keep=keep).logits
    if logits.shape[1] != keep.numel():
        raise TypeError(f"{type(model).__name__} returned {logits.shape[1]} logit rows for {keep.numel()} positions "
                        "in logits_to_keep: the trainer needs a Hugging Face causal LM whose forward takes a tensor "
                        "logits_to_keep (transformers >= 4.50 models do)")
    return logits[0]


def _laid_out_for_cp(pack, cp: int, zigzag: bool) -> bool:
    """Whether `cp_layout(pack, cp, zigzag=)` accepts the pack as it is (zig-zag: every slot divisible by 2*cp;
    contiguous: the token count divisible by cp)."""
    if not zigzag:
        return pack.num_tokens % cp == 0
    slots = (pack.cu_seqlens_with_pad[1:] - pack.cu_seqlens_with_pad[:-1]).long()
    return not bool((slots % (2 * cp)).any())


def _check_kv_head_chunk(cfg: TrainConfig, hf_config) -> None:
    """`cp_kv_head_chunk` must divide the model's KV heads (checked at init, not at the first CP forward)."""
    chunk = cfg.fsdp.cp_kv_head_chunk
    text = hf_config.get_text_config()  # a VLM's decoder config is its text_config
    n_kv = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    if cfg.cp_size > 1 and chunk is not None and n_kv % chunk:
        raise ValueError(f"cp_kv_head_chunk={chunk} does not divide the model's {n_kv} KV heads; use a divisor of "
                         f"{n_kv} or None (all heads per all-gather)")


def _forward_tiles(position_ids, hf_config, device):
    """The batch-invariant attention's tiles of one pack, built before the (compiled) layers."""
    from rlbench import numerics

    return numerics.forward_tiles(position_ids, hf_config, device)


def _engine_lse():
    """The engine sampler's per-row logsumexp in batch-invariant mode."""
    from rlbench import numerics

    return numerics.logsumexp_rows


def reset_fsdp_iteration(root) -> None:
    """Bring FSDP2's per-iteration state back to idle after a forward or backward raised (`root`: the module the
    top-level `fully_shard` was applied to).

    An exception inside backward (a CUDA OOM, a KeyboardInterrupt from a hook) skips FSDP2's post-backward final
    callback: the states whose pre-backward ran stay in their pre-backward phase and the callback stays marked
    queued. Every later forward then keeps the unsharded parameters registered and never reduce-scatters, so the
    gradients land on tensors the optimizer does not hold and no step moves a weight. After this call every
    group is resharded (the module's parameters are the optimizer's again) and the next pass starts clean; the
    failed pass's gradients are discarded (`_clear_grads` drops the accumulators).
    """
    state = root._get_fsdp_state()
    if getattr(state, "_is_root", None) is None:  # no forward ran yet (FSDP2 initialises lazily): nothing to reset
        return
    reset = getattr(root, "reset_iter_state", None)
    if reset is not None:  # torch >= 2.13: FSDP2's own recovery
        reset()
        return
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    ctx = state._state_ctx  # older torch: the same fields by hand
    for s in ctx.all_states:
        s._training_state = TrainingState.IDLE
        for group in _param_groups(s):
            group._training_state = TrainingState.IDLE
            group.reshard()
    ctx.iter_forward_root = None
    ctx.post_backward_final_callback_queued = False
    post_forward_order = getattr(state._comm_ctx, "post_forward_order", None)
    if post_forward_order is not None:
        post_forward_order.clear()


@contextlib.contextmanager
def reset_on_error(root):
    """Run a forward / backward; if it raises (anything, Ctrl-C included), reset FSDP2's state before the error
    propagates (`reset_fsdp_iteration`), so the backend is usable by the next call."""
    try:
        yield
    except BaseException:
        reset_fsdp_iteration(root)
        raise


def _param_groups(state) -> list:
    """An FSDP2 state's parameter groups: a list in newer torch (`_fsdp_param_groups`), one group or None in
    torch <= 2.11 (`_fsdp_param_group`)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]
