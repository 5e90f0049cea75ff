"""The megatron-core TrainBackend: TP / PP / SP / DP (ZeRO-1) GPTModel behind the interface the FSDP backend has.

Same inputs (packs), same loss callables and global normalisation (`rlbench.algorithms`), same metrics and
checkpoint layout (`iter_XXXXXXX/` + tracker) as `FSDPBackend`; the Trainer never asks which one it has. Training
runs megatron's own machinery: `DistributedDataParallel` (fp32 grad buffers), `get_megatron_optimizer` (Adam,
fp32 main params), `get_forward_backward_func` (1F1B under PP) and `finalize_model_grads` (DP reduction, the
q/k-norm and SP-norm gradient sums over TP). Weights are HF-named at the edges: loaded from an HF directory,
synced to the engine and exported in HF layout (`convert.py`).
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from rlbench.algorithms.logprobs import token_logprobs
from rlbench.backends.base import LossFn, PackOutputs
from rlbench.backends.checkpoint import CommittedCheckpoints
from rlbench.backends.export import buckets
from rlbench.backends.megatron import convert
from rlbench.backends.offload import Parking, to_device
from rlbench.backends.optim import lr_at
from rlbench.configs.backend import TrainConfig
from rlbench.configs.megatron import MegatronConfig
from rlbench.distributed.mesh import DistEnv, barrier, init_distributed
from rlbench.interrupts import defer_sigint, raise_if_interrupted


def _import_megatron():
    try:
        import megatron.core  # noqa: F401
    except ImportError as exc:
        raise ImportError("train_backend='megatron' needs megatron-core: pip install 'rlbench[megatron]' "
                          "(megatron-core 0.16 on Python 3.11, 0.19 on >= 3.12); TransformerEngine is not needed") from exc


class MegatronBackend(CommittedCheckpoints):
    """megatron-core actor (+ optional reference model) implementing `TrainBackend`.

    Args:
        cfg: the shared backend settings (model, dtype, optimizer, schedule, checkpoints, log-prob chunking).
        mcfg: megatron's layout (TP, PP, SP, recompute, distributed optimizer, core attention).
        loss_fn: default `train()` loss.
        temperature: the sampling temperature; log-probs / entropy are those of `softmax(logits / temperature)`.
    """

    def __init__(self, cfg: TrainConfig, mcfg: MegatronConfig | None = None, *, env: DistEnv | None = None,
                 loss_fn: LossFn | None = None, temperature: float = 1.0):
        if temperature <= 0:
            raise ValueError(f"temperature={temperature} must be > 0 (log-probs use the sampling temperature)")
        _check_supported(cfg, mcfg or MegatronConfig())
        self.cfg, self.mcfg = cfg, mcfg or MegatronConfig()
        self.env, self.loss_fn, self.temperature = env, loss_fn, temperature
        self.step = 0
        self.model = self.ref = self.optimizer = self.hf_config = self.layout = None
        self._parking = Parking()

    # ---------------------------------------------------------------- build
    def init(self) -> int:
        _import_megatron()
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from rlbench.backends.megatron.model import build_gpt, hf_state_dict, load_into, transformer_config

        cfg, m = self.cfg, self.mcfg
        if cfg.device == "cpu":
            from rlbench.backends.megatron.cpu import run_on_cpu

            run_on_cpu()
        if self.env is None:
            self.env = init_distributed(cfg.device)
        world, model_parallel = self.env.world_size, m.tensor_model_parallel_size * m.pipeline_model_parallel_size
        if world % model_parallel:
            raise ValueError(f"world size {world} is not a multiple of tensor x pipeline parallel = {model_parallel}; "
                             "launch tp * pp * dp processes")
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(m.tensor_model_parallel_size, m.pipeline_model_parallel_size)
        torch.manual_seed(cfg.seed)
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)
        dev = self.env.device
        state, self.hf_config = hf_state_dict(cfg.model, cfg, dev)
        self.layout = convert.Layout.from_hf_config(self.hf_config)
        self.tconfig = transformer_config(self.hf_config, m, cfg)
        model = build_gpt(self.hf_config, self.tconfig, dev)
        load_into(model, state, self.hf_config)
        del state
        ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                            use_distributed_optimizer=m.use_distributed_optimizer)
        self.model = DistributedDataParallel(config=self.tconfig, ddp_config=ddp, module=model)
        if cfg.ref_model is not None:
            ref_state, _ = hf_state_dict(cfg.ref_model, cfg, dev)
            self.ref = build_gpt(self.hf_config, self.tconfig, dev)
            load_into(self.ref, ref_state, self.hf_config)
            self.ref.requires_grad_(False)
            del ref_state
        o = cfg.optim
        ocfg = OptimizerConfig(
            optimizer="adam", lr=lr_at(0, o), min_lr=o.min_lr, weight_decay=o.weight_decay, adam_beta1=o.betas[0],
            adam_beta2=o.betas[1], adam_eps=o.eps, clip_grad=o.clip_grad, bf16=self.tconfig.bf16,
            fp16=self.tconfig.fp16, params_dtype=self.tconfig.params_dtype,
            use_distributed_optimizer=m.use_distributed_optimizer,
        )
        # config_overrides={}: weight decay on every parameter, as the FSDP backend's AdamW does
        self.optimizer = get_megatron_optimizer(ocfg, [self.model], config_overrides={})
        # the losses are global sums, so no division by a token count (megatron would pass the schedule's count)
        self.tconfig.finalize_model_grads_func = functools.partial(_finalize_without_token_scaling,
                                                                   finalize_model_grads)
        self.tconfig.grad_scale_func = None
        self._fwd_bwd = get_forward_backward_func()
        self._tp_group = ps.get_tensor_model_parallel_group()
        self._dp_group = ps.get_data_parallel_group()
        self._pp_group = ps.get_pipeline_model_parallel_group()
        self._last_stage = ps.is_pipeline_last_stage()
        self.step = 0
        return self.step

    # ---------------------------------------------------------------- forward
    def _packed_inputs(self, pack):
        """`(tokens [1, T'], positions [1, T'], PackedSeqParams)`; under SP the pack gets a trailing pad slot
        so T' divides by the TP size (the extra tokens are never scored)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        dev = self.env.device
        tokens, positions, cu = pack.tokens, pack.position_ids, pack.cu_seqlens_with_pad.to(torch.int32)
        tp = self.mcfg.tensor_model_parallel_size
        extra = (-tokens.numel()) % tp if self.mcfg.sequence_parallel else 0
        if extra:
            tokens = torch.cat([tokens, tokens.new_full((extra,), pack.pad_token_id)])
            positions = torch.cat([positions, torch.arange(extra, dtype=positions.dtype)])
            cu = torch.cat([cu, cu.new_tensor([tokens.numel()])])
        longest = int((cu[1:] - cu[:-1]).max())
        cu = cu.to(dev)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                                 max_seqlen_kv=longest)
        return tokens.to(dev)[None], positions.to(dev)[None], params

    def _score(self, logits: torch.Tensor, pack, with_entropy: bool):
        """Response-space `(logp [R], entropy [R] | None)` from a pack's vocab-parallel logits `[1, T', V/tp]`."""
        dev = self.env.device
        logits = logits[0, : pack.num_tokens]
        targets = torch.roll(pack.tokens, -1).to(dev)  # logp[t] scores tokens[t+1]
        if self.mcfg.tensor_model_parallel_size == 1:
            logp, ent = token_logprobs(logits, targets, self.temperature, chunk_size=self.cfg.logprob_chunk_size,
                                       with_entropy=with_entropy)
        else:
            from rlbench.backends.megatron.logprobs import vocab_parallel_logprobs

            logp, ent = vocab_parallel_logprobs(logits, targets, self.temperature, group=self._tp_group,
                                                chunk_size=self.cfg.logprob_chunk_size, with_entropy=with_entropy)
        index = pack.response_index.to(dev)
        return logp[index], (ent[index] if ent is not None else None)

    def _run(self, net, packs, per_pack, *, forward_only: bool) -> list:
        """megatron's schedule over `packs` (1F1B under PP); `per_pack(i, logp, ent) -> (loss, info)` runs on the
        last stage. Returns each pack's info, broadcast to every stage."""
        if self._parking.asleep:
            raise ValueError("the backend is asleep (its device memory is released); call wake_up() first")
        self._check_same_count(len(packs))
        items = iter(range(len(packs)))
        dev = self.env.device
        with_entropy = not forward_only and self.cfg.with_entropy or getattr(self, "_entropy_pass", False)

        def forward_step(data_iterator, model):
            i = next(data_iterator)
            tokens, positions, params = self._packed_inputs(packs[i])
            out = model(input_ids=tokens, position_ids=positions, attention_mask=None, packed_seq_params=params)

            def loss_func(output):
                logp, ent = self._score(output, packs[i], with_entropy)
                loss, info = per_pack(i, logp, ent)
                return loss, torch.ones((), dtype=torch.int, device=dev), {"info": info}

            return out, loss_func

        longest = max(p.num_tokens for p in packs) + self.mcfg.tensor_model_parallel_size
        store = self._fwd_bwd(forward_step_func=forward_step, data_iterator=items, model=[net],
                              num_microbatches=len(packs), seq_length=longest, micro_batch_size=1,
                              forward_only=forward_only)
        infos = [s["info"] for s in store] if self._last_stage else None
        if self.mcfg.pipeline_model_parallel_size > 1:
            box = [infos]
            last = dist.get_global_rank(self._pp_group, dist.get_world_size(self._pp_group) - 1)
            dist.broadcast_object_list(box, src=last, group=self._pp_group)
            infos = box[0]
        return infos

    def compute_log_prob(self, packs: Sequence[Any], *, model: str = "actor", with_entropy: bool = False
                         ) -> list[PackOutputs]:
        if model not in ("actor", "ref"):
            raise ValueError(f"model={model!r}; use 'actor' or 'ref'")
        if model == "ref" and self.ref is None:
            raise ValueError("model='ref' but no reference model was configured (set TrainConfig.ref_model)")
        net = self.model if model == "actor" else self.ref
        net.eval()

        def keep(i, logp, ent):
            info = (logp.detach().cpu(), ent.detach().cpu() if ent is not None else None)
            return logp.sum() * 0, info

        self._entropy_pass = with_entropy
        try:
            with torch.no_grad():
                infos = self._run(net, list(packs), keep, forward_only=True)
        finally:
            self._entropy_pass = False
        return [PackOutputs(lp, ent, list(p.response_lengths)) for (lp, ent), p in zip(infos, packs)]

    # ---------------------------------------------------------------- train
    def train(self, packs: Sequence[Any], loss_inputs: Sequence[Any], loss_fn: LossFn | None = None) -> dict:
        """One optimizer step over this rank's packs (global-weighted sum losses, summed over micro-batches
        and DP ranks); a step whose loss or grad norm is not finite is skipped (`train/skipped = 1`)."""
        loss_fn = loss_fn or self.loss_fn
        if loss_fn is None:
            raise ValueError("train() needs a loss_fn (pass one here or to MegatronBackend(loss_fn=...))")
        if len(packs) != len(loss_inputs):
            raise ValueError(f"{len(packs)} packs but {len(loss_inputs)} loss inputs; pass one per pack")
        t0 = time.perf_counter()
        dev = self.env.device
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

        def step_loss(i, logp, ent):
            raise_if_interrupted()
            loss, metrics = loss_fn(logp, ent, to_device(loss_inputs[i], dev))
            bad = sorted(k for k in metrics if "/" in k)
            if bad:
                raise ValueError(f"loss_fn returned metric keys {bad}; return bare names (train() adds 'train/')")
            info = {"loss": float(loss.detach())} | {k: float(torch.as_tensor(v).detach()) for k, v in metrics.items()}
            return loss, info

        infos = self._run(self.model, list(packs), step_loss, forward_only=False)
        keys = sorted({k for info in infos for k in info if k != "loss"})
        local = [sum(info["loss"] for info in infos)] + [sum(info.get(k, 0.0) for info in infos) for k in keys]
        totals = torch.tensor(local, dtype=torch.float64, device=dev)
        raise_if_interrupted()
        dist.all_reduce(totals, group=self._dp_group)  # TP peers hold the same sums; PP: broadcast already
        found_inf = self.optimizer.prepare_grads()
        clip = self.cfg.optim.clip_grad
        grad_norm = float(self.optimizer.get_grad_norm())  # over all TP / PP / DP shards, duplicates once
        if clip > 0 and grad_norm > clip and math.isfinite(grad_norm):  # megatron's rule: scale by clip / (norm + eps)
            grads = [p.grad for p in self.optimizer.get_parameters() if p.grad is not None]
            torch._foreach_mul_(grads, clip / (grad_norm + 1.0e-6))
        ok = not found_inf and bool(torch.isfinite(totals[0])) and math.isfinite(grad_norm)
        lr = lr_at(self.step, self.cfg.optim)
        if ok:
            with defer_sigint():
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                self.optimizer.step_with_ready_grads()
                self.step += 1
        self.optimizer.zero_grad()
        metrics = {f"train/{k}": float(v) for k, v in zip(keys, totals[1:])}
        return metrics | {
            "train/loss": float(totals[0]), "train/grad_norm": grad_norm, "train/lr": lr,
            "train/skipped": 0.0 if ok else 1.0, "train/step": float(self.step),
            "perf/train_time": time.perf_counter() - t0,
        }

    @torch.no_grad()
    def update_ref(self) -> dict:
        """Copy the actor's weights into the reference model (same layout: a local copy per rank)."""
        if self.ref is None:
            raise ValueError("update_ref() needs a reference model; set TrainConfig.ref_model")
        t0 = time.perf_counter()
        actor = dict(self.model.module.named_parameters())
        for name, p in self.ref.named_parameters():
            p.copy_(actor[name])
        return {"perf/ref_update_time": time.perf_counter() - t0}

    def _check_same_count(self, n: int) -> None:
        counts = torch.tensor([n, -n], device=self.env.device)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)
        if counts[0] != -counts[1]:
            raise ValueError(f"ranks have different micro-batch counts (min {-int(counts[1])}, max {int(counts[0])}); "
                             "make_packs must use the DP-wide max count (num_micro_batches(reduce_max=...))")

    # ---------------------------------------------------------------- weights
    @torch.no_grad()
    def _hf_tensors(self, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) of the actor: each parameter all-gathered over TP, then every PP stage's in turn
        (collective over all ranks)."""
        from megatron.core import parallel_state as ps

        tp_world = ps.get_tensor_model_parallel_world_size()
        stage_start = _stage_start(self.layout, self.mcfg.pipeline_model_parallel_size,
                                   ps.get_pipeline_model_parallel_rank())
        own = []
        for name, p in self.model.module.named_parameters():
            full = p.detach()
            if tp_world > 1 and convert.tp_partition_dim(name) is not None:
                shards = [torch.empty_like(full) for _ in range(tp_world)]
                dist.all_gather(shards, full.contiguous(), group=self._tp_group)
                full = convert.gather_tp_param(name, shards, self.layout)
            own.extend(convert.mcore_param_to_hf(name, full, self.layout, stage_start))
        if self.mcfg.pipeline_model_parallel_size == 1:
            for name, t in own:
                yield name, (t.to(dtype) if dtype is not None else t)
            return
        for stage in range(self.mcfg.pipeline_model_parallel_size):  # each stage's tensors to every stage
            src = dist.get_global_rank(self._pp_group, stage)
            box = [[(n, tuple(t.shape), t.dtype) for n, t in own] if ps.get_pipeline_model_parallel_rank() == stage
                   else None]
            dist.broadcast_object_list(box, src=src, group=self._pp_group)
            mine = dict(own) if ps.get_pipeline_model_parallel_rank() == stage else {}
            for name, shape, dt in box[0]:
                t = mine[name].contiguous() if name in mine else torch.empty(shape, dtype=dt, device=self.env.device)
                dist.broadcast(t, src=src, group=self._pp_group)
                yield name, (t.to(dtype) if dtype is not None else t)

    def named_weights_for_sync(self, bucket_bytes: int = 512 << 20, dtype: torch.dtype | None = torch.bfloat16
                               ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        return buckets(self._hf_tensors(dtype), bucket_bytes)

    def export_hf(self, path: str, dtype: torch.dtype | None = None) -> None:
        """A plain HF directory of the current actor weights (from_pretrained loads it); collective."""
        from safetensors.torch import save_file

        state = {n: t.cpu().contiguous() for n, t in self._hf_tensors(dtype)}
        if self.env.rank == 0:
            os.makedirs(path, exist_ok=True)
            save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
            self.hf_config.save_pretrained(path)
        barrier(self.env)

    # ---------------------------------------------------------------- checkpoints
    def _checkpoint_root(self) -> str:
        if not self.cfg.checkpoint_dir:
            raise ValueError("TrainConfig.checkpoint_dir is not set; set it to save or load checkpoints")
        return self.cfg.checkpoint_dir

    def _layout_meta(self) -> dict:
        m = self.mcfg
        return {"backend": "megatron", "world_size": self.env.world_size, "tp": m.tensor_model_parallel_size,
                "pp": m.pipeline_model_parallel_size, "distributed_optimizer": m.use_distributed_optimizer,
                "model": self.cfg.model, "model_overrides": dict(self.cfg.model_overrides)}

    def save(self, step: int | None = None, extra: dict | None = None) -> str:
        """Atomic checkpoint under `cfg.checkpoint_dir`: each rank's model and optimizer shard (rank{r}.pt), the
        layout (resumed only on the same tp/pp/world), `extra` files from rank 0; the FSDP backend's commit."""
        from rlbench.backends.checkpoint import clean_stale, commit, iter_dir, save_synced

        root, step = self._checkpoint_root(), self.step if step is None else step
        final, tmp = iter_dir(root, step), iter_dir(root, step) + ".tmp"
        try:
            if self.env.is_main:
                os.makedirs(root, exist_ok=True)
                clean_stale(root)
                os.makedirs(tmp)
            barrier(self.env)
            r = self.env.rank
            state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                     "rng": torch.get_rng_state()}
            save_synced(state, os.path.join(tmp, f"rank{r}.pt"))
            if self.mcfg.use_distributed_optimizer:
                save_synced(_optimizer_shards(self.optimizer), os.path.join(tmp, f"distopt_rank{r}.pt"))
            if self.env.is_main:
                save_synced({"step": step, "format": "megatron"} | self._layout_meta(),
                            os.path.join(tmp, "trainer_state.pt"))
                for name, obj in (extra or {}).items():
                    save_synced(obj, os.path.join(tmp, name))
            barrier(self.env)
            if self.env.is_main:
                commit(root, tmp, final, step)
        except BaseException:
            if self.env.is_main:
                import shutil

                shutil.rmtree(tmp, ignore_errors=True)
            raise
        barrier(self.env)
        return final

    def load(self, step: int | None = None) -> int:
        from rlbench.backends.checkpoint import committed_dir, latest_step

        root = self._checkpoint_root()
        step = latest_step(root) if step is None else step
        path = committed_dir(root, step) if step is not None else None
        if path is None:
            raise ValueError(f"no finished checkpoint {step} under {root!r}; save one first or pass a valid step")
        meta = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)
        want = self._layout_meta()
        diff = {k: (meta.get(k), v) for k, v in want.items() if meta.get(k) != v}
        if diff:
            raise ValueError(f"checkpoint {path!r} was written with another layout or model: {diff} "
                             "(saved, now); resume with the same settings, or export_hf() and start from the HF dir")
        state = torch.load(os.path.join(path, f"rank{self.env.rank}.pt"), weights_only=False,
                           map_location=self.env.device)
        if self.env.device.type == "cpu":  # torch.load's CPU storages cannot be resized, so sleep() could not free them
            state["optimizer"] = torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, state["optimizer"])
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.mcfg.use_distributed_optimizer:
            shards = torch.load(os.path.join(path, f"distopt_rank{self.env.rank}.pt"), weights_only=False,
                                map_location=self.env.device)
            _load_optimizer_shards(self.optimizer, shards)
        torch.set_rng_state(state["rng"])
        self.step = int(meta["step"])
        return self.step

    # ---------------------------------------------------------------- memory
    def state_tensors(self) -> list[torch.Tensor]:
        """The device tensors of the training state (params, grad buffers, fp32 main params, Adam state)."""
        out = [p for p in self.model.parameters()]
        out += [p.main_grad for p in self.model.parameters() if getattr(p, "main_grad", None) is not None]
        for buf in getattr(self.model, "buffers", []):
            out += [t for t in (getattr(buf, "param_data", None), getattr(buf, "grad_data", None)) if t is not None]
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            inner = opt.optimizer
            out += [p for g in inner.param_groups for p in g["params"]]
            out += [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return out

    def sleep(self) -> dict:
        """Park params, grad buffers, fp32 main params and Adam state in host memory (bit-exact round trip)."""
        return self._parking.park(self.state_tensors(), self.env.device, lambda: barrier(self.env))

    def wake_up(self) -> dict:
        return self._parking.unpark(lambda: barrier(self.env))


def _finalize_without_token_scaling(finalize, model, num_tokens=None, **kwargs):
    """megatron's `finalize_model_grads` without its 1/num_tokens scaling (rlbench's losses are global sums)."""
    return finalize(model, None, **kwargs)


def _optimizer_shards(optimizer) -> list[dict]:
    """This rank's part of the distributed optimizer: its fp32 main-param shards and their Adam state.

    Used instead of megatron's `save_parameter_state` (a gather of every shard to DP rank 0): checkpoints resume
    only on the same layout, so each rank keeps its own shard; and megatron 0.16's loader of that gathered
    state copies into every optimizer-state key, which fails (KeyError 'step') with torch's Adam, the optimizer
    megatron falls back to without TransformerEngine / apex."""
    out = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        params = [p for g in opt.optimizer.param_groups for p in g["params"]]
        out.append({"params": [p.detach().clone() for p in params],
                    "state": [{k: v.clone() if isinstance(v, torch.Tensor) else v
                               for k, v in opt.optimizer.state.get(p, {}).items()} for p in params]})
    return out


@torch.no_grad()  # with fp32 params the main-param shards are views of the model's parameters
def _load_optimizer_shards(optimizer, shards: list[dict]) -> None:
    """Restore what `_optimizer_shards` saved, into the same layout's optimizer."""
    opts = getattr(optimizer, "chained_optimizers", [optimizer])
    if len(opts) != len(shards):
        raise ValueError(f"the checkpoint holds {len(shards)} optimizer shards, this optimizer {len(opts)}; "
                         "resume with the same layout and model")
    for opt, saved in zip(opts, shards):
        params = [p for g in opt.optimizer.param_groups for p in g["params"]]
        if [tuple(p.shape) for p in params] != [tuple(p.shape) for p in saved["params"]]:
            raise ValueError("the checkpoint's optimizer shards have other shapes than this rank's; resume with "
                             "the same layout and model")
        for p, value, state in zip(params, saved["params"], saved["state"]):
            p.copy_(value)
            opt.optimizer.state[p] = state


def _stage_start(layout: convert.Layout, pp: int, rank: int) -> int:
    return convert.stage_layers(layout, pp)[rank].start


def _check_supported(cfg: TrainConfig, m: MegatronConfig) -> None:
    """FSDP-only settings, refused with the reason (rather than silently ignored)."""
    hints = {"cpu_offload": "use sleep()/wake_up() (colocated offload) instead",
             "gradient_checkpointing": "use MegatronConfig.recompute_granularity (--recompute-granularity full)",
             "attn_implementation": "use MegatronConfig.attention (--megatron-attention)"}
    # megatron runs eager, without FSDP's checkpointing or CPU offload: asking for them off is what it does
    honoured = {"compile": False, "gradient_checkpointing": False, "cpu_offload": False}
    bad = [f"fsdp.{k}" + (f" ({hints[k]})" if k in hints else "") for k in cfg.fsdp.changed()
           if honoured.get(k, object()) != getattr(cfg.fsdp, k)]
    if cfg.cp_size != 1:
        bad.append("cp_size (megatron's context parallelism needs TransformerEngine)")
    if cfg.batch_invariant:
        bad.append("batch_invariant (true on-policy mode uses rlbench's batch-invariant HF layers)")
    if bad:
        raise ValueError(f"the megatron backend does not take these FSDP settings: {'; '.join(bad)}")
    if cfg.device == "cpu" and cfg.param_dtype != "fp32":
        raise ValueError(f"megatron on CPU runs fp32 only (its mixed-precision optimizer checks for CUDA tensors); "
                         f"got param_dtype={cfg.param_dtype!r}: set param_dtype='fp32' or use device='cuda'")
