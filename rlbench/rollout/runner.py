"""Forward passes of the engine over the HF model: prefill, and a decode step that can be compiled and
captured in CUDA graphs (one graph per (batch bucket, kv-length bucket, sampling mode) key, captured lazily;
one dynamic-shape compile per sampling mode serves every bucket).

The decoder layers are the model's own `nn.Module`s (shared code with the trainer); only the attention
function ("rlbench_kv", see `attention.py`) and the KV cache are the engine's. All per-slot decode state
lives in preallocated device tensors, so a decode step (forward + sampling + state update) runs with no
host sync and replays as one CUDA graph.
"""

from __future__ import annotations

import warnings

import torch
import torch.fx.experimental._config as fx_config

from rlbench.rollout.attention import KVContext, decode_mask
from rlbench.rollout.kv_cache import KVCache
from rlbench.rollout.sampling import greedy_tokens, sample_tokens, token_hash

SAMPLE_MODES = ("greedy", "sample", "truncate")
"""Decode-step variants, chosen once per `SamplingParams`: argmax only; Gumbel noise; noise + top-k/top-p."""


class SlotState:
    """Per-slot decode inputs/outputs as device tensors `[S]` (static addresses for CUDA graphs)."""

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device):
        def z(dtype):
            return torch.zeros(num_slots, dtype=dtype, device=device)

        self.tokens, self.positions, self.steps, self.seeds = z(torch.long), z(torch.long), z(torch.long), z(torch.long)
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
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "layers") or not hasattr(model, "lm_head"):
        raise TypeError(f"{type(model).__name__} is not a HF decoder-only causal LM (needs .model.layers, .lm_head)")
    return base


def forward_last(model: torch.nn.Module, input_ids, position_ids, ctx: KVContext, last_index) -> torch.Tensor:
    """Run the HF layers; return logits at `last_index` of each row.

    Args:
        input_ids, position_ids: `[B, T]` long.
        ctx: the KV context the attention function reads.
        last_index: `[B]` long position of the row's last real token; None = the last position (decode).
    Returns:
        `[B, V]` logits in the model dtype.
    """
    base = _base_model(model)
    hidden = base.embed_tokens(input_ids)  # [B, T, D]
    pos_emb = base.rotary_emb(hidden, position_ids)
    for layer in base.layers:
        hidden = layer(hidden, attention_mask=None, position_ids=position_ids, position_embeddings=pos_emb, rl_kv=ctx)
    if last_index is None:
        return model.lm_head(base.norm(hidden[:, -1]))  # [B, V]; a view, no gather kernel
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    return model.lm_head(base.norm(hidden[rows, last_index]))  # [B, V]


class ModelRunner:
    """Prefill and graph-captured decode over one model and one KV cache."""

    def __init__(self, model, cache: KVCache, *, cuda_graphs: bool, compile: bool):
        self.model, self.cache = model, cache
        self.device = cache.device
        self.state = SlotState(cache.shape.num_slots, model.config.vocab_size, self.device)
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.compiled = compile and self.device.type == "cuda"
        self._step_fn = self._compiled_step() if self.compiled else self._logits_and_sample
        self._graphs: dict[tuple[int, int, str], torch.cuda.CUDAGraph] = {}
        self._pool = None
        self._warmed: set[tuple[int, int, str]] = set()

    def _compiled_step(self):
        """`torch.compile(dynamic=True)` of the step, traced without duck sizing.

        Duck sizing gives equal sizes one symbol, so a batch of 8 (= KV heads), 128 (= head_dim) or 256
        (= slots), or kv_len 1024 (= hidden) or L_max, each specialised and recompiled: ~8 compiles of the
        whole unrolled model. Without it one compile per sampling mode serves every (batch, kv_len) bucket.
        """
        import torch._dynamo

        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        compiled = torch.compile(self._logits_and_sample, dynamic=True)

        def step(*args):
            with fx_config.patch(use_duck_shape=False):
                return compiled(*args)

        return step

    # ---- prefill (eager; matmul-bound) ----
    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], slots: list[int]) -> torch.Tensor:
        """Right-pad `prompts` into `[B, T]`, write their K/V into `slots`; return last-token logits `[B, V]`."""
        t = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), t, dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, : len(p)] = torch.tensor(p)
        ids = ids.to(self.device)
        pos = torch.arange(t, device=self.device).expand(len(prompts), t)
        last = torch.tensor([len(p) - 1 for p in prompts], device=self.device)
        ctx = KVContext(self.cache.k, self.cache.v, torch.tensor(slots, device=self.device), decode=False)
        return forward_last(self.model, ids, pos, ctx, last)

    # ---- decode ----
    def _logits_and_sample(self, tokens, positions, temperature, top_k, top_p, seeds, steps, kv_len: int,
                           mode: str):
        """One decode step for slots `[0, B)`: `[B]` inputs -> (tokens `[B]`, log_probs `[B]`); see SAMPLE_MODES."""
        b = tokens.shape[0]
        ctx = KVContext(self.cache.k, self.cache.v, self.state.slot_ids[:b], decode=True, positions=positions,
                        kv_len=kv_len, mask=decode_mask(positions, kv_len))
        logits = forward_last(self.model, tokens[:, None], positions[:, None], ctx, None)
        if mode == "greedy":
            return greedy_tokens(logits)
        return sample_tokens(logits, temperature, top_k, top_p, seeds, steps, self.state.vocab_hash,
                             mode == "truncate")

    def _decode_eager(self, b: int, kv_len: int, mode: str) -> None:
        s = self.state
        tok, lp = self._step_fn(s.tokens[:b], s.positions[:b], s.temperature[:b], s.top_k[:b], s.top_p[:b],
                                s.seeds[:b], s.steps[:b], kv_len, mode)
        s.out_tokens[:b].copy_(tok)
        s.out_log_probs[:b].copy_(lp)
        s.tokens[:b].copy_(tok)
        s.positions[:b].add_(1).clamp_(max=self.cache.shape.max_seq_len - 1)
        s.steps[:b].add_(1)

    @torch.inference_mode()
    def decode(self, b: int, kv_len: int, mode: str) -> None:
        """Advance slots `[0, b)` by one token; results land in `state.out_tokens/out_log_probs[:b]`.

        `mode` (one of SAMPLE_MODES) must hold for every row in `[0, b)`: "greedy" ignores temperatures.
        """
        if mode not in SAMPLE_MODES:
            raise ValueError(f"mode={mode!r} must be one of {SAMPLE_MODES}")
        key = (b, kv_len, mode)
        graph = self._graphs.get(key)
        if graph is not None:
            graph.replay()
            return
        if self.cuda_graphs:
            self._capture(key)
            return
        if self.compiled and key not in self._warmed:
            saved = self.state.snapshot()
            self._warm_up(key)
            self.state.restore(saved)
            self._warmed.add(key)
        self._decode_eager(*key)

    def _warm_up(self, key: tuple[int, int, str]) -> None:
        """Run the step twice on a side stream (this compiles on first use); a failed compile falls back."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                try:
                    self._decode_eager(*key)
                except Exception as err:  # torch.compile is an optimisation: fall back loudly, not silently
                    if self._step_fn is self._logits_and_sample:
                        raise
                    warnings.warn(f"torch.compile of the decode step failed ({type(err).__name__}: {err}); "
                                  "decoding without compile (compile=False)", stacklevel=3)
                    self._step_fn, self.compiled = self._logits_and_sample, False
        torch.cuda.current_stream().wait_stream(stream)

    def _capture(self, key: tuple[int, int, str]) -> None:
        """Warm up, capture the step into a graph and replay it once; the state is restored in between."""
        saved = self.state.snapshot()
        self._warm_up(key)
        self.state.restore(saved)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                self._decode_eager(*key)
        except RuntimeError as err:  # capture is an optimisation: say so loudly and run eager from now on
            warnings.warn(f"CUDA graph capture failed for {key} ({err}); decoding eagerly (cuda_graphs=False)",
                          stacklevel=3)
            self.cuda_graphs = False
            torch.cuda.synchronize()
            self.state.restore(saved)
            self._decode_eager(*key)
            return
        self._graphs[key] = graph
        graph.replay()

    def clear_graphs(self) -> None:
        """Drop captured graphs (the cache or weights moved: `sleep`)."""
        self._graphs.clear()
        self._pool = None
