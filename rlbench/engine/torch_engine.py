"""The embedded torch rollout engine: continuous batching over a slot KV cache, on the HF model itself.

Loop of `generate`: admit waiting prompts into free slots (one batched prefill), then run `steps_per_sync`
decode steps over slots `[0, B)` (graph-captured on GPU), copy the new tokens to the host once, apply stop
rules, free finished slots, repeat.

The n > 1 samples of a prompt share its prefilled K/V (`TorchEngineConfig.shared_prefix`): the cache is seen in
its grouped layout (`KVCache.group_view(n)`), a prompt takes one group row of n slots, its samples decode as
rows `[g n, (g + 1) n)` and read the prompt once per step; the group row is freed when its last sample ends.
Otherwise (n = 1 or `shared_prefix=False`) every sample has its own slot, and the n samples of a prompt copy
its prefilled K/V.

Sessions (`rlbench.engine.sessions`): `generate(keep=True)` keeps each finished sample's slot; `continue_`
prefills only an observation (plus the last sampled token) into it and samples the next turn, in the same
continuous batch as fresh prompts. Kept samples live in the slot layout: a call decoded in the grouped layout moves
its kept samples into their own slots at its end (`KVCache.ungroup`), and while any session is open calls use the
slot layout (an idle group row would overwrite a kept slot).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from rlbench.configs.engine import TorchEngineConfig
from rlbench.engine.attention import ATTN_NAME
from rlbench.engine.kv_cache import CacheShape, KVCache, slot_bytes, slots_for_memory
from rlbench.engine.protocol import Generation, SamplingParams, Session, WeightBucket, expand_seeds
from rlbench.engine.quantize import weight_rounder
from rlbench.engine.runner import ModelRunner
from rlbench.engine.sampling import sample_tokens
from rlbench.engine.sessions import SessionTable, check_slots, plan_turn
from rlbench.host_memory import retain_freed_host_memory
from rlbench.models.capabilities import TORCH_ENGINE, TRUE_ON_POLICY, check_model
from rlbench.models.moe import patch_moe
from rlbench.models.weight_layout import export_layout
from rlbench.packing.pack import bucket_length
from rlbench.types import ImageInputs


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
    max_new: int = 0
    """Tokens this turn may sample (`max_new_tokens`, or what is left of `max_seq_len` for a session)."""
    session: Session | None = None
    """The session this sample belongs to: the one it continues, or the one `keep` opened when it finished."""
    prompt: Sequence[int] = ()
    """A fresh sample's prompt (a kept sample's session starts from it)."""
    rope_delta: int = 0
    """M-RoPE offset of its prompt's images (`engine.vision`; 0 for text)."""


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
    """`RolloutEngine` over a HF causal LM (the same `nn.Module` class the trainer uses); a `SessionEngine`.

    Args:
        model: e.g. from `rlbench.models.build_model`/`load_model`; its attention is switched to
            "rlbench_kv" (plain SDPA when called without the engine's KV context).
        cfg: sizes and switches.
        tokenizer: needed only for `SamplingParams.stop` strings.
    """

    supports_sessions = True

    def __init__(self, model: torch.nn.Module, cfg: TorchEngineConfig | None = None, tokenizer=None):
        self.cfg = cfg or TorchEngineConfig()
        check_model(model.config, TORCH_ENGINE, self.cfg.max_seq_len)
        if self.cfg.batch_invariant:
            check_model(model.config, TRUE_ON_POLICY, self.cfg.max_seq_len)
        self.model = model.eval().requires_grad_(False)
        self.model.config._attn_implementation = ATTN_NAME
        self.tokenizer = tokenizer
        self.weight_version = 0
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self._released: dict[str, tuple[torch.Size, torch.dtype]] = {}
        self._disk_names: dict | None = None  # on-disk name -> (parameter, index): `_named_tensors`, built once
        self._abort = False
        self._on_finish: Callable[[Generation], None] | None = None
        if self.device.type == "cpu":
            retain_freed_host_memory()  # the sampler's [rows, vocab] temporaries reuse freed blocks
        if self.cfg.batch_invariant:  # the trainer's numerics (`rlbench.numerics`): checked on this machine first
            from rlbench.numerics import make_batch_invariant, self_test

            self_test(self.device, self.dtype, compiled=self.cfg.on_device(self.device.type == "cuda").compile)
            make_batch_invariant(self.model)  # MoE routers and experts included (`rlbench.models.moe`)
        else:  # MoE: rlbench's experts, static shapes and no host sync at decode (`rlbench.models.moe`)
            patch_moe(self.model, strict=False)  # other MoE classes keep HF's own forward
        self.cache = KVCache(self._cache_shape(), self.dtype, self.device)
        self.runner = ModelRunner(model, self.cache, self.cfg.on_device(self.device.type == "cuda"))
        self.sessions = SessionTable()
        self._images: Sequence[ImageInputs | None] | None = None
        """The running `generate` call's images per prompt (None: text only)."""
        """Samples kept between turns (`generate(keep=True)`, `continue_`, `release`)."""

    def _cache_shape(self) -> CacheShape:
        c = self.model.config.get_text_config()
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
        on_finish: Callable[[Generation], None] | None = None, *, keep: bool = False,
        images: Sequence[ImageInputs | None] | None = None,
    ) -> list[Generation]:
        """Generate `sampling.n` samples per prompt; returns them ordered by (prompt_index, sample_index).
        `on_finish` gets each finished sample's `Generation` as soon as it stops (aborted ones only in the list).
        `keep`: every finished sample keeps its KV slot as a session (`Generation.session`; see `continue_`), so
        the call needs `len(prompts) * n` free slots. `images`: per prompt its `ImageInputs` (None: text), for a
        VLM whose prompts hold the image tokens its processor expanded (`rlbench.data.images`)."""
        self._check_ready(prompts, sampling)
        self._check_images(prompts, images, keep)
        check_slots(self.cache.shape.num_slots, len(self.sessions), len(prompts), sampling.n, 0, keep)
        self._images = images
        return self._run(prompts, sampling, expand_seeds(len(prompts), sampling, seeds), [], keep, on_finish)

    def _check_images(self, prompts, images, keep: bool) -> None:
        if images is None or all(im is None for im in images):
            return
        if not self.runner.mrope:
            raise ValueError(f"images given to {type(self.model).__name__}, a text-only model; use a vision-language "
                             "model (Qwen2-VL / Qwen2.5-VL) or drop the images")
        if len(images) != len(prompts):
            raise ValueError(f"got {len(images)} image entries for {len(prompts)} prompts; pass one (or None) each")
        if keep:
            raise ValueError("sessions (keep=True) with images are not supported yet: multi-turn VLM rollouts would "
                             "need the images' offsets carried per session; generate image prompts with keep=False")

    def continue_(
        self, sessions: Sequence[Session], appended: Sequence[Sequence[int]], sampling: SamplingParams,
        seeds: Sequence[int] | None = None, on_finish: Callable[[Generation], None] | None = None, *,
        keep: bool = True, prompts: Sequence[Sequence[int]] = (), prompt_seeds: Sequence[int] | None = None,
    ) -> list[Generation]:
        """Append `appended[i]` (an observation's token ids) to `sessions[i]` and sample its next turn.

        Only the tokens the slot does not hold yet run through the model: the last token sampled before (decode
        had not consumed it) and the appended ones, at their positions. A turn samples like a fresh prompt of the
        whole context with seed `seeds[i]` (`sampling.seed + i` without seeds): sample step 0 is the turn's first
        token. `sampling.n` applies to `prompts` only (one sample per session). A context that would pass
        `max_seq_len` takes the appended tokens that fit and samples until it is full; with no room left the turn
        ends at once; either way with finish reason "length".

        Args:
            sessions: open sessions of this engine (`Generation.session` of a `keep=True` call).
            appended: per session, the token ids to append (loss mask 0 in the session's record).
            keep: the sessions stay open after their turn (False: each is released when its turn ends).
            prompts, prompt_seeds: fresh prompts generated in the same call (continuous batching), as
                `generate(prompts, sampling, prompt_seeds, keep=keep)` would; their results follow the sessions'
                with `prompt_index = len(sessions) + i`.

        Returns:
            One `Generation` per session (this turn's tokens; `session` updated), then the prompts' samples.
        """
        if len(appended) != len(sessions):
            raise ValueError(f"got {len(appended)} appended token lists for {len(sessions)} sessions; pass one each")
        self._check_ready(prompts, sampling)
        self._images = None
        kept = self.sessions.lookup(sessions)
        check_slots(self.cache.shape.num_slots, len(self.sessions), len(prompts), sampling.n, len(sessions), keep)
        one = expand_seeds(len(sessions), dataclasses.replace(sampling, n=1), seeds)
        turns = []
        for i, (k, tokens) in enumerate(zip(kept, appended)):
            taken, max_new = plan_turn(k.length, [int(t) for t in tokens], self.cfg.max_seq_len,
                                       sampling.max_new_tokens)
            self.sessions.append(k, taken)
            seq = _Seq(i, 0, k.length, one[i][0], k.slot, max_new=max_new, session=k.session)
            turns.append((seq, list(k.tail), k.length - len(k.tail)))  # the suffix and its first position
        return self._run(prompts, sampling, expand_seeds(len(prompts), sampling, prompt_seeds), turns, keep,
                         on_finish)

    def release(self, sessions: Iterable[Session]) -> None:
        """Close `sessions` and free their slots (closed ones are skipped)."""
        self.sessions.release(sessions)

    @property
    def free_slots(self) -> int:
        """Slots not held by open sessions."""
        return self.cache.shape.num_slots - len(self.sessions)

    def _run(self, prompts, sampling: SamplingParams, seeds, turns: list, keep: bool, on_finish) -> list[Generation]:
        """Continue `turns` (`(_Seq, suffix, start)`) and generate `prompts` in one continuous batch."""
        self._on_finish, self._keep, self._abort = on_finish, keep, False
        n, base = sampling.n, len(turns)
        # The grouped layout only while no slot is kept: its idle group rows would write into a kept slot.
        grouped = (self.cfg.shared_prefix and n > 1 and not self.sessions
                   and (not keep or len(prompts) <= self.cache.shape.num_slots // n))
        self._group = n if grouped else 1
        self._live: dict[int, int] = {}  # group row -> samples still running (grouped layout)
        self.cache.reset(self._group, self.sessions.slots())
        waiting = deque(range(len(prompts)))
        running: list[_Seq] = []
        done: list[_Seq] = []
        self._continue(turns, sampling, running, done)
        while (waiting or running) and not self._abort:
            while self._admit(prompts, sampling, seeds, waiting, running, done, base):
                pass  # prefill first: fill every free slot before decoding
            if running:
                self._decode_window(sampling, running, done)
        self.runner.check_errors()
        for seq in running:
            seq.finish_reason = "abort"
            if seq.session is not None:  # an aborted turn is recorded, and its session closed
                self.sessions.record(seq.session, seq.tokens, seq.log_probs, seq.prompt_len)
                self.sessions.close(seq.session)
        done += running
        done += [_Seq(base + i, j, len(prompts[i]), seeds[i][j], finish_reason="abort")
                 for i in waiting for j in range(n)]
        if self._group > 1 and keep:
            self._ungroup(done)
        done.sort(key=lambda s: (s.prompt_index, s.sample_index))
        return [self._generation(s) for s in done]

    def _generation(self, seq: _Seq) -> Generation:
        return Generation(seq.prompt_index, seq.tokens, seq.log_probs, seq.finish_reason, self.weight_version,
                          seq.sample_index, seq.session)

    def _finished(self, seq: _Seq, done: list[_Seq]) -> None:
        """`seq` stopped: record it in its session (opening one if kept), free or keep its slot, report it."""
        done.append(seq)
        if self._keep and seq.session is None:
            seq.session = self.sessions.open(seq.prompt, seq.slot)
        if seq.session is not None:
            self.sessions.record(seq.session, seq.tokens, seq.log_probs, seq.prompt_len)
        if not self._keep:
            self._free(seq)
        if self._on_finish is not None:
            self._on_finish(self._generation(seq))

    def _ungroup(self, done: list[_Seq]) -> None:
        """Move the kept samples of the grouped layout into their own slots (slot `row * k + j`: no other slot)."""
        rows: dict[int, tuple[int, int]] = {}  # group row -> (prompt length, positions to move)
        for seq in done:
            if seq.session is not None and seq.session.open:
                row, length = seq.slot // self._group, seq.prompt_len + len(seq.tokens) - 1
                rows[row] = (seq.prompt_len, max(length, rows.get(row, (0, 0))[1]))
        for row, (prefix, length) in rows.items():
            self.cache.ungroup(row, self._group, prefix, length)

    def warm_up(self, truncate: bool = False, greedy: bool = False) -> int:
        """Compile and capture every decode graph now (GPU with cuda_graphs) instead of on first use.

        One sampling mode per call: top-k/top-p (`truncate`), greedy (`greedy`, T = 0) or plain sampling.
        Returns the number of (batch, kv-length) buckets run. Idle slots are decoded, which is harmless (a kept
        session's slot is written only past its cached positions, which its next turn rewrites).
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
        """Stop the running call (from another thread) after the current decode window. Its unfinished samples
        come back with finish reason "abort" and are not kept; a session whose turn is aborted records the partial
        turn and is closed. Sessions outside the call stay open."""
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

    def _continue(self, turns: list, sampling: SamplingParams, running: list[_Seq], done: list[_Seq]) -> None:
        """Prefill the turns' suffixes into their slots (batches within `max_prefill_tokens`) and start them."""
        batch: list = []
        for seq, suffix, start in turns:
            if seq.max_new == 0:  # no room left: nothing to prefill
                seq.finish_reason = "length"
                self._finished(seq, done)
                continue
            longest = max(len(x[1]) for x in [*batch, (seq, suffix)])
            if batch and longest * (len(batch) + 1) > self.cfg.max_prefill_tokens:
                self._extend(batch, sampling, running, done)
                batch = []
            batch.append((seq, suffix, start))
        if batch:
            self._extend(batch, sampling, running, done)

    def _extend(self, batch: list, sampling: SamplingParams, running: list[_Seq], done: list[_Seq]) -> None:
        seqs = [seq for seq, _, _ in batch]
        logits = self.runner.extend([suffix for _, suffix, _ in batch], [start for _, _, start in batch],
                                    [seq.slot for seq in seqs])
        self._begin(seqs, logits, sampling, running, done)

    def _admit(self, prompts, sampling: SamplingParams, seeds, waiting: deque, running: list, done: list,
               base: int = 0) -> bool:
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
        seqs = [[_Seq(base + i, j, len(prompts[i]), seeds[i][j], max_new=sampling.max_new_tokens, prompt=prompts[i])
                 for j in range(sampling.n)] for i in batch]
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
        images = None if self._images is None else [self._images[i] for i in batch]
        logits = self.runner.prefill([list(prompts[i]) for i in batch], targets, group=k, images=images)
        for group, delta in zip(seqs, self.runner.prefill_deltas):
            for seq in group:
                seq.rope_delta = delta
        for group in seqs:
            if k == 1:
                self.cache.copy_prefix(group[0].slot, [s.slot for s in group[1:]], group[0].prompt_len)
        self._begin([s for g in seqs for s in g], logits.repeat_interleave(sampling.n, dim=0), sampling, running,
                    done)
        return True

    def _begin(self, seqs: list[_Seq], logits: torch.Tensor, sampling: SamplingParams, running: list[_Seq],
               done: list[_Seq]) -> None:
        """Sample the first token of each of `seqs` from its prefill logits `[len(seqs), V]` and start decoding."""
        tokens, log_probs = self._first_tokens(logits, seqs, sampling)
        self._start_slots(seqs, tokens, sampling)
        for seq, tok, lp in zip(seqs, tokens.tolist(), log_probs.tolist()):
            if self._append(seq, tok, lp, sampling):
                self._finished(seq, done)
            else:
                running.append(seq)

    def _free(self, seq: _Seq) -> None:
        """Give a finished sample's slot back; in the grouped layout its group row, after the last sample. A
        continued session (`keep=False`) is closed."""
        if seq.session is not None:
            self.sessions.close(seq.session)
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
        st.rope_delta[idx] = torch.tensor([s.rope_delta for s in seqs], device=dev)
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
        elif len(seq.tokens) >= seq.max_new:
            seq.finish_reason = "length"
        return seq.finish_reason is not None

    def _hit_stop_string(self, tokens: list[int], stops: list[str]) -> bool:
        if not stops:
            return False
        tail = self.tokenizer.decode(tokens[-(max(len(s) for s in stops) + 4):])
        return any(s in tail for s in stops)

    # ---- weights and memory ----
    def _named_tensors(self) -> dict[str, torch.Tensor]:
        """HF names -> parameters, tied aliases included (`lm_head.weight` when tied to the embedding), and the
        on-disk names where the checkpoint layout differs (`rlbench.models.weight_layout`: one tensor per MoE
        expert) -> the view of the in-memory tensor they fill."""
        named = dict(self.model.named_parameters(remove_duplicate=False))
        named.update(dict(self.model.named_buffers(remove_duplicate=False)))
        if self._disk_names is None:
            self._disk_names = export_layout(self.model).from_disk()
        for disk, (param, index) in self._disk_names.items():
            named[disk] = named[param][index]
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
        """Free the KV cache (and the weights' storage, keeping shapes, when `release_weights`). Refused while
        sessions are open: their K/V would be lost under them."""
        if self.sessions:
            raise RuntimeError(f"sleep() would free the KV cache under {len(self.sessions)} open sessions; release() "
                               "them first (or flush_cache() to drop every session)")
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
        """Drop every KV state: close all open sessions (continuing one then raises) and free every slot."""
        self.sessions.close_all()
        self.cache.reset()


def _truncates(sampling: SamplingParams) -> bool:
    return sampling.temperature > 0 and (sampling.top_k > 0 or sampling.top_p < 1)


def _mode(sampling: SamplingParams) -> str:
    """The decode-step variant (`runner.SAMPLE_MODES`), chosen once per `SamplingParams`."""
    if sampling.temperature <= 0:
        return "greedy"
    return "truncate" if _truncates(sampling) else "sample"
