"""Forward passes of the engine over the HF model: prefill, and a decode step that can be compiled and
captured in CUDA graphs (one graph per (batch bucket, kv-length bucket, sampling mode, group) key, captured
lazily).

The decode step is three compiled pieces joined by a Python loop: a prologue (embedding, RoPE tables,
mask), ONE decoder-layer function called once per layer with that layer's weights and KV cache as
arguments, and a head (final norm, lm_head, sampling). Dynamo reuses a graph when the code and the guards
match, so one dynamic-shape layer graph serves every layer and every (batch, kv_len) bucket: warm-up compiles
one layer instead of the unrolled model. The CUDA graph still captures the whole step, Python glue included.

With the megakernel on (and supported: `megakernel.build`), a batch-1 step replaces the per-layer loop by stage
kernels chained with programmatic dependent launch, or one persistent kernel with grid barriers; the prologue
stays compiled, and the head (final norm, lm_head, sampling, state update) runs as two Triton kernels except for
top-k/top-p steps.

The layer forward is the engine's own over fused QKV / gate-up weights (`fused.py`), or the HF module's
forward (other architectures, `fused_weights=False`); only the attention (`attention.py`) and the KV cache
are the engine's either way. All per-slot decode state lives in preallocated device tensors, so a decode
step (forward + sampling + state update) runs with no host sync and replays as one CUDA graph.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings

import torch
import torch._dynamo
import torch.fx.experimental._config as fx_config

from rlbench.configs.engine import TorchEngineConfig
from rlbench.engine import megakernel
from rlbench.engine.attention import Extend, KVContext, decode_attention, decode_mask, group_decode_mask
from rlbench.engine.fused import LayerOps, fuse_layers, fused_layer_forward, hf_layer_forward
from rlbench.engine.kv_cache import KVCache
from rlbench.engine.sampling import greedy_tokens, logsumexp_rows, sample_tokens, token_hash
from rlbench.engine.vision import image_prefill, text_model
from rlbench.models.vlm import is_mrope

SAMPLE_MODES = ("greedy", "sample", "truncate")
"""Decode-step variants, chosen once per `SamplingParams`: argmax only; Gumbel noise; noise + top-k/top-p."""
COMPILE_FAILURES = 2
"""Decode shapes whose compile may fail before the engine stops compiling any (`Runner._compile_failed`)."""


class SlotState:
    """Per-slot decode inputs/outputs as device tensors `[S]` (static addresses for CUDA graphs)."""

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device):
        def z(dtype):
            return torch.zeros(num_slots, dtype=dtype, device=device)

        self.tokens, self.positions, self.steps, self.seeds = z(torch.long), z(torch.long), z(torch.long), z(torch.long)
        self.rope_delta = z(torch.long)
        """M-RoPE models (VLMs): each slot's RoPE position minus its cache position (`engine.vision`); else 0."""
        self.prefix_len = z(torch.long) + 1
        """Prompt length of each slot's sample (the grouped layout's write index and mask; >= 1 for idle slots)."""
        self.top_k, self.temperature, self.top_p = z(torch.long), z(torch.float32), z(torch.float32)
        self.out_tokens, self.out_log_probs = z(torch.long), z(torch.float32)
        self.slot_ids = torch.arange(num_slots, device=device)
        self.vocab_hash = token_hash(vocab_size, device)

    def snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for t in (self.tokens, self.positions, self.steps)]

    def restore(self, saved: list[torch.Tensor]) -> None:
        for dst, src in zip((self.tokens, self.positions, self.steps), saved):
            dst.copy_(src)


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    base = text_model(model)
    if base is None or not hasattr(base, "layers") or not hasattr(model, "lm_head"):
        raise TypeError(f"{type(model).__name__} is not a HF decoder-only causal LM (needs .model.layers, .lm_head)")
    return base


def layer_rope_types(base: torch.nn.Module, text_config) -> list[str] | None:
    """Per decoder layer, the layer type whose RoPE table it reads, where the model's `rotary_emb` takes a
    `layer_type` (Gemma3: local and global bases); None where one table serves every layer."""
    if "layer_type" not in inspect.signature(base.rotary_emb.forward).parameters:
        return None
    return list(text_config.layer_types[: text_config.num_hidden_layers])


def _compile(fn, gemv_batch1: bool, backend, options: dict | None = None):
    """`torch.compile(dynamic=True)` of `fn`, traced without duck sizing and with float specialisation.

    Duck sizing gives equal sizes one symbol, so a batch of 8 (= KV heads), 128 (= head_dim) or 256
    (= slots), or kv_len 1024 (= hidden) or L_max, each specialised and recompiled. Without it one compile
    serves every (batch, kv_len) bucket. Weights are `nn.Parameter`s and the cache is marked static, so
    only the batch and kv_len are symbolic.
    """
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    # gpt-fast's recipe: with coordinate-descent tuning inductor lowers a matmul whose M is statically 1
    # to a fused GEMV reduction (cuBLAS is launch/tile bound at these sizes).
    options = dict(options or {}) | ({"coordinate_descent_tuning": True} if gemv_batch1 else {})
    compiled = torch.compile(fn, dynamic=True, backend=backend, options=options if backend == "inductor" else None)

    def call(*args):
        # Floats (norm eps, attention scale) are constants, not graph inputs.
        with fx_config.patch(use_duck_shape=False), torch._dynamo.config.patch(specialize_float=True):
            return compiled(*args)

    return call


class ModelRunner:
    """Prefill and graph-captured decode over one model and one KV cache."""

    def __init__(self, model, cache: KVCache, cfg: TorchEngineConfig | None = None, compile_backend="inductor"):
        """`cfg` is taken as given (`TorchEngineConfig.on_device` turns compile and CUDA graphs off on the CPU);
        `compile_backend` is torch.compile's backend (tests pass a counting one)."""
        opts = cfg or TorchEngineConfig()
        self.model, self.cache, self.opts, self.compile_backend = model, cache, opts, compile_backend
        self.base = _base_model(model)
        self.device = cache.device
        text = model.config.get_text_config()
        self.state = SlotState(cache.shape.num_slots, text.vocab_size, self.device)
        torch._dynamo.mark_static(self.state.vocab_hash)
        self.cuda_graphs = opts.cuda_graphs and self.device.type == "cuda"
        self.heads_per_kv = text.num_attention_heads // text.num_key_value_heads
        self.lse = logsumexp_rows
        """The log-probs' per-row logsumexp (batch-invariant: `rlbench.numerics.logsumexp_rows`, the trainer's)."""
        if opts.batch_invariant:
            from rlbench import numerics

            self.lse = numerics.logsumexp_rows
        self.mrope = is_mrope(model)
        """Whether RoPE takes 3-D positions (a VLM, `engine.vision`): decode adds `state.rope_delta`."""
        types = layer_rope_types(self.base, text)
        self._rope_types = sorted(set(types or ()))
        self.rope_index = None if types is None else [self._rope_types.index(t) for t in types]
        """Per decoder layer, the index of its RoPE table (per-layer-type RoPE, Gemma3), or None: one table."""
        self.max_len = cache.shape.max_seq_len
        """Positions per sequence (sliding windows at least this long are dropped: `attention_extras`)."""
        self.final_softcap = getattr(text, "final_logit_softcapping", None)
        """Final-logit soft-capping `c tanh(z / c)` (Gemma2/3), or None."""
        self.layers: list = []
        self.bind_weights()
        self.megakernel = megakernel.build(model, self.base, self.layers if self.fused else None,
                                           cache.shape.max_seq_len, self.device, opts.megakernel)
        """The batch-1 decoder (None: batch 1 takes the compiled path)."""
        self._graphs: dict[tuple[int, int, str, int], torch.cuda.CUDAGraph] = {}
        self._pool = None
        self._warmed: set[tuple[int, int, str, int]] = set()
        self._eager_keys: set[tuple[int, int, str, int]] = set()
        """Decode shapes `(batch, kv_len, mode, group)` whose compile failed: they run eagerly, the others compiled."""
        self._fn_sets: dict[bool, tuple] = {}
        """The step's functions, compiled (True) and eager (False), each built once (`_use_compiled`)."""
        self._use_compiled(opts.compile)
        self.prefilled_tokens = 0
        self.prefill_deltas: list[int] = []
        """The M-RoPE offsets of the last `prefill`'s prompts (0 without images)."""
        """Real (unpadded) tokens run through `prefill` and `extend` so far: what sessions save shows here."""

    @property
    def fused(self) -> bool:
        """Whether the engine's fused-weight layer forward runs (else the HF layers')."""
        return self._layer_forward is not hf_layer_forward

    @property
    def min_batch(self) -> int:
        """Smallest batch bucket: compiled steps start at 2 (batch 1 would be one more graph) unless
        `gemv_batch1` asks for that graph or the megakernel runs batch 1."""
        return 1 if not self.compiled or self.opts.gemv_batch1 or self.megakernel is not None else 2

    def bind_weights(self) -> None:
        """(Re-)read the layers' weights, fusing them when configured (after init and `wake_up`). Batch-invariant:
        with the batch-invariant ops (`rlbench.numerics`), where fused GEMMs give the separate ones' columns."""
        ops = None
        if self.opts.batch_invariant:
            from rlbench import numerics

            dtype = next(self.model.parameters()).dtype
            if numerics.columns_invariant(self.device, dtype):
                ops = LayerOps(linear=numerics.ops.linear, rms_norm=numerics.ops.rms_norm, silu=numerics.ops.silu,
                               attention=numerics.kv_attention)
        may_fuse = self.opts.fused_weights and (ops is not None or not self.opts.batch_invariant)
        fused = fuse_layers(self.model) if may_fuse else None
        if fused is None:
            self._layer_forward = hf_layer_forward
        elif ops is None:
            self._layer_forward = fused_layer_forward
        else:
            self._layer_forward = functools.partial(fused_layer_forward, ops=ops)
        self.layers = list(self.base.layers) if fused is None else fused

    def release_weights(self) -> None:
        """Drop the fused weight tensors (`sleep(release_weights=True)`); `bind_weights` rebuilds them."""
        self.layers = []
        if self.megakernel is not None:
            self.megakernel.unbind()  # it holds the layers (and TMA descriptors of them) too

    def _use_compiled(self, compiled: bool) -> None:
        """Point the step at its compiled or eager functions (each set built once: switching back and forth, as
        `_step` does for a shape whose compile failed, keeps the compiled graphs)."""
        self.compiled = compiled
        if compiled not in self._fn_sets:
            self._fn_sets[compiled] = self._functions(compiled)
        self._attend, self._prologue_fn, self._embed_fn, self._layer_fn, self._head_fn = self._fn_sets[compiled]

    def _functions(self, compiled: bool) -> tuple:
        """`(attend, prologue, embed, layer, head)` of the decode step, compiled or eager."""
        cuda = self.device.type == "cuda"
        # The decode attention of the slot layout (False) and of the grouped layout (True).
        attend = {group: decode_attention(self.opts.decode_attention, compiled=compiled, grouped=group, cuda=cuda)
                  for group in (False, True)}
        # Coordinate-descent tuning (for the batch-1 GEMV graph) benchmarks every kernel of every graph in a cold
        # compile; where the megakernel decodes batch 1 no layer graph runs at batch 1, so it is skipped.
        tune = self.opts.gemv_batch1 and self.megakernel is None
        if compiled and self.opts.batch_invariant:
            # Batch-invariant numerics: the decoder layer and the head (sampling, the temperature division around
            # the opaque logsumexp) are compiled with eager's rounding; the prologue (RoPE tables: cos/sin) runs
            # eagerly, as the trainer's does.
            from rlbench import numerics

            options = numerics.compile_options()
            return (attend, self._prologue, self._embed,
                    _compile(self._invariant_layer, False, self.compile_backend, options),
                    _compile(self._invariant_head, False, self.compile_backend, options))
        wrap = (lambda fn: _compile(fn, tune, self.compile_backend)) if compiled else (lambda fn: fn)
        return attend, wrap(self._prologue), wrap(self._embed), wrap(self._layer), wrap(self._head)

    # ---- prefill (eager; matmul-bound) ----
    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], slots: list[int], group: int = 1, images=None) -> torch.Tensor:
        """Right-pad `prompts` into `[B, T]`, write their K/V into `slots` (group rows of `group_view(group)`);
        return last-token logits `[B, V]`. `images`: per prompt its `ImageInputs` or None (an M-RoPE VLM); their
        RoPE offsets are left in `self.prefill_deltas` (`[B]`, 0 without images)."""
        t = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), t, dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, : len(p)] = torch.tensor(p)
        ids = ids.to(self.device)
        pos = torch.arange(t, device=self.device).expand(len(prompts), t)
        last = torch.tensor([len(p) - 1 for p in prompts], device=self.device)
        slot_ids = torch.tensor(slots, device=self.device)
        hidden = self.embed(ids)  # [B, T, D]
        self.prefill_deltas = [0] * len(prompts)
        if images is not None and any(im is not None for im in images):
            hidden, pos, self.prefill_deltas = image_prefill(self.model, hidden, ids, [len(p) for p in prompts], images)
        tables = self.rope(hidden, pos)
        for i, (w, kc, vc) in enumerate(zip(self.layers, *self.cache.group_view(group))):
            hidden = self._layer_forward(w, hidden, self._table(tables, i), KVContext(kc, vc, slot_ids, decode=False, max_len=self.max_len))
        self.prefilled_tokens += sum(len(p) for p in prompts)
        rows = torch.arange(len(prompts), device=self.device)
        return self.logits(hidden[rows, last])  # [B, V]

    @torch.inference_mode()
    def extend(self, suffixes: list[list[int]], starts: list[int], slots: list[int]) -> torch.Tensor:
        """Append `suffixes[b]` to the sequence in slot `slots[b]` (slot layout), whose positions `< starts[b]` the
        cache holds: write their K/V at positions `starts[b]...` and return each row's last-token logits `[B, V]`.
        Only the suffixes run through the model (a session's next turn does not re-prefill its context)."""
        lengths = [len(s) for s in suffixes]
        t, dev = max(lengths), self.device
        ids = torch.zeros(len(suffixes), t, dtype=torch.long)
        for row, suffix in enumerate(suffixes):
            ids[row, : len(suffix)] = torch.tensor(suffix)
        # padding runs on past the row's tokens (clamped in range); nothing reads it
        pos = (torch.tensor(starts)[:, None] + torch.arange(t)).clamp(max=self.cache.shape.max_seq_len - 1)
        real = torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]  # [B, T]
        rows, cols = real.nonzero(as_tuple=True)
        masks = [(torch.arange(s + n)[None, :] <= s + torch.arange(n)[:, None]).to(dev)
                 for s, n in zip(starts, lengths)]
        ext = Extend(slots, starts, lengths, torch.tensor(slots)[rows].to(dev), pos[rows, cols].to(dev),
                     (rows * t + cols).to(dev), masks)
        if self.opts.batch_invariant:
            from rlbench import numerics

            ext.tiles = numerics.extend_tiles(starts, lengths, slots, t, self.model.config, dev)
        hidden = self.embed(ids.to(dev))  # [B, T, D]
        pos = pos.to(dev)
        if self.mrope:  # RoPE positions continue past the images: the cache position plus the slot's offset
            pos = pos + self.state.rope_delta[torch.tensor(slots, device=dev)][:, None]
        tables = self.rope(hidden, pos)
        slot_ids = torch.tensor(slots, device=dev)
        for i, (w, kc, vc) in enumerate(zip(self.layers, self.cache.k, self.cache.v)):
            ctx = KVContext(kc, vc, slot_ids, decode=False, extend=ext, max_len=self.max_len)
            hidden = self._layer_forward(w, hidden, self._table(tables, i), ctx)
        self.prefilled_tokens += sum(lengths)
        last = torch.tensor(lengths, device=dev) - 1
        return self.logits(hidden[torch.arange(len(suffixes), device=dev), last])  # [B, V]

    # ---- the model's own prologue and head (embedding scale, RoPE tables per layer type, soft-capping) ----
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids `[B, T]` -> hidden `[B, T, D]`, as the HF model's forward embeds them."""
        hidden = self.base.embed_tokens(ids)
        normalizer = getattr(self.base, "normalizer", None)  # Gemma in transformers versions that scale in forward
        return hidden if normalizer is None else hidden * normalizer.to(hidden.dtype)

    def rope(self, hidden: torch.Tensor, pos: torch.Tensor):
        """RoPE `(cos, sin)` of positions `pos` `[B, T]` (M-RoPE: also `[3, B, T]`; `[B, T]` is text, all rows
        equal): one table, or with per-layer-type RoPE the tables stacked `[R, B, T, hd]` (layer i reads table
        `rope_index[i]`)."""
        if self.mrope and pos.dim() == 2:
            pos = pos[None].expand(3, *pos.shape)
        if self.rope_index is None:
            return self.base.rotary_emb(hidden, pos)
        tables = [self.base.rotary_emb(hidden, pos, layer_type=t) for t in self._rope_types]
        return torch.stack([c for c, _ in tables]), torch.stack([s for _, s in tables])

    def _table(self, tables, layer: int):
        """Layer `layer`'s `(cos, sin)` out of `rope`'s."""
        if self.rope_index is None:
            return tables
        r = self.rope_index[layer]
        return tables[0][r], tables[1][r]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm, lm_head and soft-capping: hidden `[B, D]` -> logits `[B, V]`."""
        logits = self.model.lm_head(self.base.norm(hidden))
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    # ---- decode: prologue -> layer x N -> head ----
    def _embed(self, tokens, positions):
        """`[B]` tokens/positions -> hidden `[B, 1, D]`, RoPE (cos, sin) `[B, 1, hd]` (all the megakernel needs)."""
        hidden = self.embed(tokens[:, None])
        if self.mrope:
            positions = positions + self.state.rope_delta[: tokens.shape[0]]
        cos, sin = self.rope(hidden, positions[:, None])
        return hidden, cos, sin

    def _prologue(self, tokens, positions, prefix_len, kv_len: int, group: int):
        """`_embed`, the write index `[B]` (None: the positions) and the mask: `[B, 1, 1, kv_len]`, or with
        `group` k > 1 the grouped layout's `[B / k, 1, k G, kv_len]` (`attention.group_decode_mask`)."""
        if group == 1:
            return *self._embed(tokens, positions), None, decode_mask(positions, kv_len)
        index, mask = group_decode_mask(positions, prefix_len, group, self.heads_per_kv, kv_len)
        return *self._embed(tokens, positions), index, mask

    def _layer(self, w, hidden, cos, sin, k_cache, v_cache, slots, positions, prefix_len, index, mask, kv_len: int,
               group: int):
        """One decoder layer of the decode step; `w` and the caches are this layer's (graph inputs)."""
        ctx = KVContext(k_cache, v_cache, slots, decode=True, positions=positions, kv_len=kv_len, mask=mask,
                        decode_attention=self._attend[group > 1], group=group, write_index=index,
                        prefix_len=prefix_len, max_len=self.max_len)
        return self._layer_forward(w, hidden, (cos, sin), ctx)

    def _invariant_layer(self, *args):
        """`_layer` from another code object, for the batch-invariant engine: dynamo keeps its compiled graphs per
        code object, and these are built with other inductor options than the default engine's (in one process,
        a default engine compiled after a batch-invariant one failed in inductor and decoded eagerly)."""
        return self._layer(*args)

    def _invariant_head(self, *args):
        """`_head` from another code object, for the batch-invariant engine (see `_invariant_layer`)."""
        return self._head(*args)

    def _head(self, hidden, temperature, top_k, top_p, seeds, steps, vocab_hash, mode: str):
        """Final norm, lm_head and sampling: hidden `[B, 1, D]` -> (tokens `[B]`, log_probs `[B]`)."""
        logits = self.logits(hidden[:, -1])  # [B, V]
        if mode == "greedy":
            return greedy_tokens(logits, self.lse)
        return sample_tokens(logits, temperature, top_k, top_p, seeds, steps, vocab_hash, mode == "truncate",
                             self.lse)

    def _layer_stack(self, hidden, cos, sin, positions, index, mask, kv_len: int, group: int):
        """Every decoder layer for slots `[0, B)`, one layer graph call each: hidden `[B, 1, D]` -> `[B, 1, D]`."""
        b = hidden.shape[0]
        slots, prefix_len = self.state.slot_ids[:b], self.state.prefix_len[:b]
        for i, (w, kc, vc) in enumerate(zip(self.layers, *self.cache.group_view(group))):
            c, s = self._table((cos, sin), i)
            hidden = self._layer_fn(w, hidden, c, s, kc, vc, slots, positions, prefix_len, index, mask, kv_len, group)
        return hidden

    def _logits_and_sample(self, tokens, positions, temperature, top_k, top_p, seeds, steps, kv_len: int,
                           mode: str, group: int = 1):
        """One decode step for slots `[0, B)`: `[B]` inputs -> (tokens `[B]`, log_probs `[B]`); see SAMPLE_MODES."""
        if self.megakernel is not None and tokens.shape[0] == 1:
            hidden = self.megakernel.layers(*self._embed_fn(tokens, positions), positions)  # every layer, slot 0
        else:
            b = tokens.shape[0]
            hidden, cos, sin, index, mask = self._prologue_fn(tokens, positions, self.state.prefix_len[:b], kv_len,
                                                              group)
            hidden = self._layer_stack(hidden, cos, sin, positions, index, mask, kv_len, group)
        return self._head_fn(hidden, temperature, top_k, top_p, seeds, steps, self.state.vocab_hash, mode)

    def _decode_eager(self, b: int, kv_len: int, mode: str, group: int = 1) -> None:
        s, max_pos = self.state, self.cache.shape.max_seq_len - 1
        if b == 1 and self.megakernel is not None and self.megakernel.step(self._embed_fn, s, mode, max_pos):
            return
        tok, lp = self._logits_and_sample(s.tokens[:b], s.positions[:b], s.temperature[:b], s.top_k[:b],
                                          s.top_p[:b], s.seeds[:b], s.steps[:b], kv_len, mode, group)
        if self.megakernel is not None and self.megakernel.finish_step(s, b, tok, lp, max_pos):
            return
        s.out_tokens[:b].copy_(tok)
        s.out_log_probs[:b].copy_(lp)
        s.tokens[:b].copy_(tok)
        s.positions[:b].add_(1).clamp_(max=max_pos)
        s.steps[:b].add_(1)

    @torch.inference_mode()
    def decode(self, b: int, kv_len: int, mode: str, group: int = 1) -> None:
        """Advance slots `[0, b)` by one token; results land in `state.out_tokens/out_log_probs[:b]`.

        `mode` (one of SAMPLE_MODES) must hold for every row in `[0, b)`: "greedy" ignores temperatures.
        `group` k > 1: the cache's grouped layout (`KVCache.group_view(k)`; b a multiple of k, kv_len the
        positions read per group row).
        """
        if mode not in SAMPLE_MODES:
            raise ValueError(f"mode={mode!r} must be one of {SAMPLE_MODES}")
        if b % group:
            raise ValueError(f"batch {b} is not a multiple of the group size {group}")
        key = (b, kv_len, mode, group)
        graph = self._graphs.get(key)
        if graph is not None:
            graph.replay()
            return
        if b == 1 and self.megakernel is not None:  # outside any capture: the pointer table is a host copy
            self.bind_megakernel()
        if self.cuda_graphs:
            self._capture(key)
            return
        if self.compiled and key not in self._warmed:
            saved = self.state.snapshot()
            self._warm_up(key)
            self.state.restore(saved)
            self._warmed.add(key)
        self._step(key)

    def _step(self, key: tuple[int, int, str, int]) -> None:
        """One decode step of shape `key`, eager where its compile failed (`_warm_up`)."""
        if key not in self._eager_keys or not self.compiled:
            self._decode_eager(*key)
            return
        self._use_compiled(False)
        try:
            self._decode_eager(*key)
        finally:
            self._use_compiled(True)

    def _warm_up(self, key: tuple[int, int, str, int]) -> None:
        """Run the step twice (on a side stream on CUDA; this compiles on first use); a failed compile falls back."""
        for t in (*self.cache.k, *self.cache.v, *sum(self.cache.group_view(key[3]), [])):
            torch._dynamo.mark_static(t)  # re-allocated by wake_up; static shapes for the compile
        cuda = self.device.type == "cuda"
        stream = torch.cuda.Stream() if cuda else None
        if cuda:
            stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
            for _ in range(2):
                try:
                    self._step(key)
                except Exception as err:  # torch.compile is an optimisation: fall back loudly, not silently
                    if not self.compiled or key in self._eager_keys:
                        raise
                    self._compile_failed(key, err)
        if cuda:
            torch.cuda.current_stream().wait_stream(stream)

    def _compile_failed(self, key: tuple[int, int, str, int], err: Exception) -> None:
        """A failed compile of shape `key`: that shape decodes eagerly from now on; after `COMPILE_FAILURES` shapes
        failed, every shape does (a compile that fails everywhere would otherwise cost its time at each new shape)."""
        self._eager_keys.add(key)
        everywhere = len(self._eager_keys) >= COMPILE_FAILURES
        b, kv_len, mode, group = key
        warnings.warn(f"torch.compile of the decode step failed at batch {b}, kv_len {kv_len}, mode {mode}, group "
                      f"{group} ({type(err).__name__}: {str(err).strip().splitlines()[0]}); "
                      + ("decoding every shape without compile (compile=False)" if everywhere
                         else "this shape decodes without compile, the others stay compiled"), stacklevel=4)
        if everywhere:
            self._use_compiled(False)

    def _capture(self, key: tuple[int, int, str, int]) -> None:
        """Warm up, capture the step into a graph and replay it once; the state is restored in between."""
        saved = self.state.snapshot()
        self._warm_up(key)
        self.state.restore(saved)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                self._step(key)
        except RuntimeError as err:  # capture is an optimisation: say so loudly and run eager from now on
            warnings.warn(f"CUDA graph capture failed for {key} ({err}); decoding eagerly (cuda_graphs=False)",
                          stacklevel=3)
            self.cuda_graphs = False
            torch.cuda.synchronize()
            self.state.restore(saved)
            self._step(key)
            return
        self._graphs[key] = graph
        graph.replay()

    def bind_megakernel(self) -> None:
        """Point the megakernel at the current weights and cache; if they moved, drop the batch-1 graphs captured
        before, whose Gluon stages hold TMA descriptors of the old addresses as kernel parameters."""
        if self.megakernel.bind(self.layers, self.cache.k, self.cache.v):
            for old in [k for k in self._graphs if k[0] == 1]:
                del self._graphs[old]

    def check_errors(self) -> None:
        """Raise if a batch-1 megakernel launch since the last check timed out at a grid barrier."""
        if self.megakernel is not None:
            self.megakernel.check()

    def clear_graphs(self) -> None:
        """Drop captured graphs (the cache or weights moved: `sleep`)."""
        self._graphs.clear()
        self._pool = None
