"""The embedded torch rollout engine: continuous batching over a slot KV cache, on the HF model itself.

Loop of `generate`: admit waiting prompts into free slots (one batched prefill), then run `steps_per_sync`
decode steps over slots `[0, B)` (graph-captured on GPU), copy the new tokens to the host once, apply stop
rules, free finished slots, repeat.

The n > 1 samples of a prompt share its prefilled K/V (`TorchEngineConfig.shared_prefix`): the cache is seen in
its grouped layout (`KVCache.group_view(n)`), a prompt takes one group row of n slots, its samples decode as
rows `[g n, (g + 1) n)` and read the prompt once per step; the group row is freed when its last sample ends.
Otherwise (n = 1 or `shared_prefix=False`) every sample has its own slot, and the n samples of a prompt copy
its prefilled K/V.
"""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from rlbench.configs.engine import TorchEngineConfig
from rlbench.engine.attention import ATTN_NAME
from rlbench.engine.kv_cache import CacheShape, KVCache, slot_bytes, slots_for_memory
from rlbench.engine.protocol import Generation, SamplingParams, WeightBucket, expand_seeds
from rlbench.engine.quantize import weight_rounder
from rlbench.engine.runner import ModelRunner
from rlbench.engine.sampling import sample_tokens
from rlbench.host_memory import retain_freed_host_memory
from rlbench.packing.pack import bucket_length


@dataclass
class _Seq:
    """Host-side record of one running sample."""

    prompt_index: int
    sample_index: int
    prompt_len: int
    seed: int
    slot: int = -1
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    finish_reason: str | None = None


KV_FLOOR = 256
"""Smallest kv-length bucket: attention over <= 256 cached positions costs little next to the GEMVs, and a
higher floor means fewer (batch, kv_len) graphs to capture (4 kv buckets for L_max = 1536, not 6)."""


def group_kv_bucket(x: int, cap: int) -> int:
    """Positions read per group row in the grouped layout: `packing.bucket_length`'s ladder (128-multiples to
    1024, then 8 per doubling), at least KV_FLOOR: the window grows by n positions a step, so a power of two
    would read up to twice what is written."""
    return min(cap, max(KV_FLOOR, bucket_length(x)))


def bucket(x: int, cap: int, floor: int) -> int:
    """Smallest power of two >= x (at least `floor`), capped at `cap`."""
    return min(cap, max(floor, 1 << max(0, x - 1).bit_length()))


def all_buckets(cap: int, floor: int) -> list[int]:
    """Every value `bucket` can return for this cap and floor."""
    return sorted({bucket(x, cap, floor) for x in [1 << i for i in range(cap.bit_length() + 1)] + [cap]})


class TorchEngine:
    """`RolloutEngine` over a HF causal LM (the same `nn.Module` class the trainer uses).

    Args:
        model: e.g. from `rlbench.models.build_model`/`load_model`; its attention is switched to
            "rlbench_kv" (plain SDPA when called without the engine's KV context).
        cfg: sizes and switches.
        tokenizer: needed only for `SamplingParams.stop` strings.
    """

    def __init__(self, model: torch.nn.Module, cfg: TorchEngineConfig | None = None, tokenizer=None):
        self.cfg = cfg or TorchEngineConfig()
        self.model = model.eval().requires_grad_(False)
        self.model.config._attn_implementation = ATTN_NAME
        self.tokenizer = tokenizer
        self.weight_version = 0
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self._released: dict[str, tuple[torch.Size, torch.dtype]] = {}
        self._abort = False
        self._on_finish: Callable[[Generation], None] | None = None
        if self.device.type == "cpu":
            retain_freed_host_memory()  # the sampler's [rows, vocab] temporaries reuse freed blocks
        if self.cfg.batch_invariant:  # the trainer's numerics (`rlbench.numerics`): checked on this machine first
            from rlbench.numerics import make_batch_invariant, self_test

            self_test(self.device, self.dtype, compiled=self.cfg.on_device(self.device.type == "cuda").compile)
            make_batch_invariant(self.model)
        self.cache = KVCache(self._cache_shape(), self.dtype, self.device)
        self.runner = ModelRunner(model, self.cache, self.cfg.on_device(self.device.type == "cuda"))

    def _cache_shape(self) -> CacheShape:
        c = self.model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        dims = (c.num_hidden_layers, c.num_key_value_heads, head_dim)
        slots = self.cfg.num_slots
        if slots is None and self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            per_slot = slot_bytes(*dims, self.cfg.max_seq_len, self.dtype)
            slots = slots_for_memory(free, self.cfg.mem_fraction, per_slot, self.cfg.max_slots)
        return CacheShape(*dims, num_slots=8 if slots is None else slots, max_seq_len=self.cfg.max_seq_len)

    # ---- generation ----
    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, seeds: Sequence[int] | None = None,
        on_finish: Callable[[Generation], None] | None = None,
    ) -> list[Generation]:
        """Generate `sampling.n` samples per prompt; returns them ordered by (prompt_index, sample_index).
        `on_finish` gets each finished sample's `Generation` as soon as it stops (aborted ones only in the list)."""
        self._check_ready(prompts, sampling)
        self._on_finish = on_finish
        all_seeds = expand_seeds(len(prompts), sampling, seeds)
        waiting = deque(range(len(prompts)))
        running: list[_Seq] = []
        done: list[_Seq] = []
        self._abort = False
        self._group = sampling.n if self.cfg.shared_prefix and sampling.n > 1 else 1
        self._live: dict[int, int] = {}  # group row -> samples still running (grouped layout)
        self.cache.reset(self._group)
        while (waiting or running) and not self._abort:
            while self._admit(prompts, sampling, all_seeds, waiting, running, done):
                pass  # prefill first: fill every free slot before decoding
            if running:
                self._decode_window(sampling, running, done)
        self.runner.check_errors()
        for seq in running:
            seq.finish_reason = "abort"
        done += running
        done += [_Seq(i, j, len(prompts[i]), all_seeds[i][j], finish_reason="abort")
                 for i in waiting for j in range(sampling.n)]
        done.sort(key=lambda s: (s.prompt_index, s.sample_index))
        return [self._generation(s) for s in done]

    def _generation(self, seq: _Seq) -> Generation:
        return Generation(seq.prompt_index, seq.tokens, seq.log_probs, seq.finish_reason, self.weight_version,
                          seq.sample_index)

    def _finished(self, seq: _Seq, done: list[_Seq]) -> None:
        """`seq` stopped: free its cache unit and report it."""
        done.append(seq)
        self._free(seq)
        if self._on_finish is not None:
            self._on_finish(self._generation(seq))

    def warm_up(self, truncate: bool = False, greedy: bool = False) -> int:
        """Compile and capture every decode graph now (GPU with cuda_graphs) instead of on first use.

        One sampling mode per call: top-k/top-p (`truncate`), greedy (`greedy`, T = 0) or plain sampling.
        Returns the number of (batch, kv-length) buckets run. Idle slots are decoded, which is harmless.
        """
        shape = self.cache.shape
        floor = self.runner.min_batch
        mode = "greedy" if greedy else "truncate" if truncate else "sample"
        keys = [(b, kv) for b in all_buckets(shape.num_slots, floor)
                for kv in all_buckets(shape.max_seq_len, KV_FLOOR)]
        for b, kv in keys:
            self.runner.decode(b, kv, mode)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return len(keys)

    def abort(self) -> None:
        """Stop the running `generate` (from another thread) after the current decode window."""
        self._abort = True

    def _check_ready(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> None:
        if self._released or not self.cache.allocated:
            raise RuntimeError("the engine is asleep; call wake_up() (and update_weights if weights were released)")
        if sampling.n > self.cache.shape.num_slots:
            raise ValueError(f"n={sampling.n} exceeds num_slots={self.cache.shape.num_slots}; raise num_slots")
        if sampling.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: TorchEngine(model, cfg, tokenizer=...)")
        for i, p in enumerate(prompts):
            if not 0 < len(p) <= self.cfg.max_seq_len - sampling.max_new_tokens:
                raise ValueError(
                    f"prompt {i} has {len(p)} tokens; with max_new_tokens={sampling.max_new_tokens} it must be "
                    f"in [1, {self.cfg.max_seq_len - sampling.max_new_tokens}]; raise TorchEngineConfig.max_seq_len"
                )

    def _admit(self, prompts, sampling: SamplingParams, seeds, waiting: deque, running: list, done: list) -> bool:
        """Prefill one batch of waiting prompts (free slots and the prefill budget permitting); True if any."""
        batch: list[int] = []
        k = self._group
        units = 1 if k > 1 else sampling.n  # cache units a prompt takes
        while waiting and self.cache.num_free >= units * (len(batch) + 1):
            longest = max(len(prompts[i]) for i in [*batch, waiting[0]])
            if batch and longest * (len(batch) + 1) > self.cfg.max_prefill_tokens:
                break
            batch.append(waiting.popleft())
        if not batch:
            return False
        seqs = [[_Seq(i, j, len(prompts[i]), seeds[i][j]) for j in range(sampling.n)] for i in batch]
        targets = []  # the prefill's cache rows: a slot, or a group row
        for group in seqs:
            if k > 1:
                targets.append(self.cache.take())
                self._live[targets[-1]] = k
                for seq in group:
                    seq.slot = targets[-1] * k + seq.sample_index
            else:
                for seq in group:
                    seq.slot = self.cache.take()
                targets.append(group[0].slot)
        logits = self.runner.prefill([list(prompts[i]) for i in batch], targets, group=k)
        for group in seqs:
            if k == 1:
                self.cache.copy_prefix(group[0].slot, [s.slot for s in group[1:]], group[0].prompt_len)
        flat = [s for g in seqs for s in g]
        tokens, log_probs = self._first_tokens(logits.repeat_interleave(sampling.n, dim=0), flat, sampling)
        self._start_slots(flat, tokens, sampling)
        for seq, tok, lp in zip(flat, tokens.tolist(), log_probs.tolist()):
            if self._append(seq, tok, lp, sampling):
                self._finished(seq, done)
            else:
                running.append(seq)
        return True

    def _free(self, seq: _Seq) -> None:
        """Give a finished sample's slot back; in the grouped layout its group row, after the last sample."""
        if self._group == 1:
            self.cache.give_back(seq.slot)
            return
        unit = seq.slot // self._group
        self._live[unit] -= 1
        if not self._live[unit]:
            self.cache.give_back(unit)

    def _params(self, n: int, sampling: SamplingParams):
        dev = self.device
        return (torch.full((n,), float(sampling.temperature), device=dev),
                torch.full((n,), sampling.top_k, device=dev, dtype=torch.long),
                torch.full((n,), float(sampling.top_p), device=dev))

    def _first_tokens(self, logits: torch.Tensor, seqs: list[_Seq], sampling: SamplingParams):
        temp, top_k, top_p = self._params(len(seqs), sampling)
        seeds = torch.tensor([s.seed for s in seqs], device=self.device)
        steps = torch.zeros(len(seqs), dtype=torch.long, device=self.device)
        return sample_tokens(logits, temp, top_k, top_p, seeds, steps, self.runner.state.vocab_hash,
                             _truncates(sampling), self.runner.lse)

    def _start_slots(self, seqs: list[_Seq], first: torch.Tensor, sampling: SamplingParams) -> None:
        """Write the new sequences' decode state into their slots."""
        st, dev = self.runner.state, self.device
        idx = torch.tensor([s.slot for s in seqs], device=dev)
        temp, top_k, top_p = self._params(len(seqs), sampling)
        st.tokens[idx] = first
        st.positions[idx] = torch.tensor([s.prompt_len for s in seqs], device=dev)
        st.prefix_len[idx] = st.positions[idx]
        st.steps[idx] = 1
        st.seeds[idx] = torch.tensor([s.seed for s in seqs], device=dev)
        st.temperature[idx], st.top_k[idx], st.top_p[idx] = temp, top_k, top_p

    def _decode_window(self, sampling: SamplingParams, running: list[_Seq], done: list[_Seq]) -> None:
        """`steps_per_sync` decode steps, one host copy, then stop checks."""
        k, grp, shape = self.cfg.steps_per_sync, self._group, self.cache.shape
        if grp == 1:
            b = bucket(max(s.slot for s in running) + 1, shape.num_slots, self.runner.min_batch)
            longest = max(s.prompt_len + len(s.tokens) for s in running) + k
            kv_len = bucket(longest, shape.max_seq_len, KV_FLOOR)
        else:  # whole group rows; per group row the prompt plus n interleaved tokens per step
            units = self.cache.num_units  # compiled: at least 2 group rows, so one layer graph serves every count
            floor = min(units, 2 if self.runner.compiled else 1)
            b = grp * bucket(max(s.slot for s in running) // grp + 1, units, floor)
            longest = max(s.prompt_len + (len(s.tokens) + k) * grp for s in running)
            kv_len = group_kv_bucket(longest, grp * shape.max_seq_len)
        st = self.runner.state
        out_tok = torch.empty(k, b, dtype=torch.long, device=self.device)
        out_lp = torch.empty(k, b, dtype=torch.float32, device=self.device)
        mode = _mode(sampling)
        for step in range(k):
            self.runner.decode(b, kv_len, mode, grp)
            out_tok[step].copy_(st.out_tokens[:b])
            out_lp[step].copy_(st.out_log_probs[:b])
        toks, lps = out_tok.T.tolist(), out_lp.T.tolist()  # the one host sync of the window
        if b == 1:
            self.runner.check_errors()  # a timed-out barrier stalls every launch: stop at the first window
        for seq in list(running):
            for tok, lp in zip(toks[seq.slot], lps[seq.slot]):
                if self._append(seq, tok, lp, sampling):
                    running.remove(seq)
                    self._finished(seq, done)
                    break

    def _append(self, seq: _Seq, tok: int, lp: float, sampling: SamplingParams) -> bool:
        """Record one token; return True when the sample is finished (sets `finish_reason`)."""
        seq.tokens.append(tok)
        seq.log_probs.append(lp)
        may_stop = not sampling.ignore_eos and len(seq.tokens) >= sampling.min_new_tokens
        if may_stop and (tok in sampling.stop_token_ids or self._hit_stop_string(seq.tokens, sampling.stop)):
            seq.finish_reason = "stop"
        elif len(seq.tokens) >= sampling.max_new_tokens:
            seq.finish_reason = "length"
        return seq.finish_reason is not None

    def _hit_stop_string(self, tokens: list[int], stops: list[str]) -> bool:
        if not stops:
            return False
        tail = self.tokenizer.decode(tokens[-(max(len(s) for s in stops) + 4):])
        return any(s in tail for s in stops)

    # ---- weights and memory ----
    def _named_tensors(self) -> dict[str, torch.Tensor]:
        """HF names -> parameters, tied aliases included (`lm_head.weight` when tied to the embedding)."""
        named = dict(self.model.named_parameters(remove_duplicate=False))
        named.update(dict(self.model.named_buffers(remove_duplicate=False)))
        return named

    @torch.no_grad()
    def update_weights(self, buckets: Iterable[WeightBucket], version: int) -> None:
        """Copy each `(name, tensor)` into the parameter of that HF name, in place (no reallocation); with
        `cfg.weight_format` each matrix is rounded to that format first (`rlbench.engine.quantize`)."""
        if self._released:
            raise RuntimeError("weights were released by sleep(release_weights=True); call wake_up() first")
        named = self._named_tensors()
        rounder = weight_rounder(self.cfg.weight_format)
        for weights in buckets:
            for name, tensor in weights:
                if name not in named:
                    raise ValueError(f"unknown weight {name!r}: expected HF parameter names like "
                                     f"{next(iter(named))!r}")
                if named[name].shape != tensor.shape:
                    raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, engine expects "
                                     f"{tuple(named[name].shape)}")
                if rounder is not None and tensor.dim() >= 2:
                    tensor = rounder(tensor.to(named[name].device))
                named[name].copy_(tensor, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the caller may reuse its (pinned) bucket memory right away
        self.weight_version = version

    def sleep(self, release_weights: bool = False) -> None:
        """Free the KV cache (and the weights' storage, keeping shapes, when `release_weights`)."""
        self.runner.clear_graphs()
        self.cache.release()
        if release_weights:
            self.runner.release_weights()  # the fused tensors own the q/k/v and gate/up storage
            for name, p in self.model.named_parameters():
                self._released[name] = (p.shape, p.dtype)
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        """Re-allocate the KV cache (and released weights, uninitialised: `update_weights` refills them)."""
        params = dict(self.model.named_parameters())
        for name, (shape, dtype) in self._released.items():
            params[name].data = torch.empty(shape, dtype=dtype, device=self.device)
        if self._released:
            self.runner.bind_weights()
            warnings.warn("weights were re-allocated uninitialised; call update_weights before generate",
                          stacklevel=2)
        self._released = {}
        if not self.cache.allocated:
            self.cache.allocate()

    def flush_cache(self) -> None:
        """No prefix cache is kept between calls; this only frees every slot."""
        self.cache.reset()


def _truncates(sampling: SamplingParams) -> bool:
    return sampling.temperature > 0 and (sampling.top_k > 0 or sampling.top_p < 1)


def _mode(sampling: SamplingParams) -> str:
    """The decode-step variant (`runner.SAMPLE_MODES`), chosen once per `SamplingParams`."""
    if sampling.temperature <= 0:
        return "greedy"
    return "truncate" if _truncates(sampling) else "sample"
