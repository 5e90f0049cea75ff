"""The rollout-engine contract: token ids in; token ids, log-probs, finish reasons and weight versions out.

Every engine (the embedded torch engine, SGLang) implements `RolloutEngine`; the rollout manager and the
weight-sync code talk only to this protocol. Sessions (multi-turn: continue a kept sample from its token ids and
KV cache) are an optional capability: `SessionEngine`, checked with `supports_sessions(engine)`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import torch

FinishReason = Literal["stop", "length", "abort"]
WeightBucket = list[tuple[str, torch.Tensor]]


@dataclass
class SamplingParams:
    """How to sample one batch of prompts (the same settings for every prompt of the call)."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (log-probs are then reported at temperature 1)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches `top_p` (1 = off)."""
    top_k: int = 0
    """Keep only the `top_k` most likely tokens (0 or -1 = off)."""
    max_new_tokens: int = 128
    """Generate at most this many tokens per sample (finish reason "length")."""
    min_new_tokens: int = 0
    """Ignore stop tokens / stop strings until this many tokens were generated (benchmarks use it)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end a sample (included in the output, finish reason "stop")."""
    stop: list[str] = field(default_factory=list)
    """Strings that end a sample once the decoded response contains them (needs a tokenizer)."""
    ignore_eos: bool = False
    """Never stop on `stop_token_ids` or `stop` (generate exactly `max_new_tokens`)."""
    n: int = 1
    """Samples per prompt; they share the prompt's prefill."""
    seed: int | None = None
    """Base seed: sample j of prompt i uses seed `seed + i * n + j` unless `generate(seeds=)` is given.
    None draws fresh seeds."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]; use 1.0 to disable nucleus sampling")
        if self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be >= -1 (0 or -1 disables top-k)")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens={self.min_new_tokens} must be in [0, max_new_tokens={self.max_new_tokens}]"
            )
        if self.n < 1:
            raise ValueError(f"n={self.n} must be >= 1 (samples per prompt)")
        if isinstance(self.stop, str):
            raise TypeError(f"stop={self.stop!r} must be a list of strings, e.g. stop=[{self.stop!r}]")


@dataclass
class Generation:
    """One generated sample.

    Attributes:
        prompt_index: index of the prompt in the `generate` call (the n samples of a prompt share it).
        sample_index: which of the prompt's n samples this is (0..n-1).
        token_ids: generated token ids (stop token included, stop string text included).
        log_probs: per generated token, `log_softmax(logits / T)` at the sampled token (T = 1 when greedy).
        finish_reason: "stop" (stop token / string), "length" (max_new_tokens) or "abort".
        weight_version: the engine's weight version when the sample was generated.
        session: with `keep=True` (`SessionEngine`): the kept sample, to pass to `continue_`/`release`; else None.
    """

    prompt_index: int
    token_ids: list[int]
    log_probs: list[float]
    finish_reason: FinishReason
    weight_version: int
    sample_index: int = 0
    session: Session | None = None


@dataclass(eq=False)
class Session:
    """A sample kept by a `SessionEngine` between turns, and everything its turns produced.

    The engine appends to it: each `continue_` adds the observation's tokens (loss mask 0, log-prob 0.0), then the
    tokens sampled in that turn (loss mask 1, their rollout log-probs). Nothing is re-tokenized: `token_ids` are
    exactly the ids the engine conditioned on and sampled. `response_ids`, `log_probs` and `loss_mask` are aligned
    (one entry per token after the prompt), the layout of `Sample.response` / `rollout_log_probs` / `loss_mask`.

    Attributes:
        id: the engine's handle for the kept slot.
        prompt_ids: the first turn's prompt.
        response_ids: every token after the prompt, sampled and appended, in order.
        log_probs: per response token, the log-prob it was sampled with (0.0 on appended tokens).
        loss_mask: per response token, 1 if sampled, 0 if appended (observation / tool output).
        turns: generation turns so far (the first `generate` counts).
        open: False once the engine let the slot go (`release`, `flush_cache`, an aborted turn, `keep=False`).
    """

    id: int
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    turns: int = 0
    open: bool = True

    @property
    def token_ids(self) -> list[int]:
        """The whole context: prompt then response."""
        return self.prompt_ids + self.response_ids

    def append(self, token_ids: Sequence[int], log_probs: Sequence[float] | None = None) -> None:
        """Add sampled tokens (with their `log_probs`; mask 1) or, without log-probs, appended tokens (mask 0)."""
        self.response_ids += list(token_ids)
        if log_probs is None:
            self.log_probs += [0.0] * len(token_ids)
            self.loss_mask += [0] * len(token_ids)
        else:
            self.log_probs += list(log_probs)
            self.loss_mask += [1] * len(token_ids)


@runtime_checkable
class RolloutEngine(Protocol):
    """What the rollout manager and the weight-sync code need from an inference engine."""

    weight_version: int

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, seeds: Sequence[int] | None = None
    ) -> list[Generation]:
        """Generate `sampling.n` samples per prompt; results are ordered by (prompt_index, sample_index).

        An engine may also take `on_finish: Callable[[Generation], None]` and call it with each sample as soon
        as it stops; the rollout manager then scores samples while the rest are generated (`RewardPool`)."""
        ...

    def update_weights(self, buckets: Iterable[WeightBucket], version: int) -> None:
        """Copy HF-named tensors into the engine's weights in place and set `weight_version = version`."""
        ...

    def sleep(self, release_weights: bool = False) -> None:
        """Free the KV cache (and the weights' memory when asked; shapes are kept for `update_weights`)."""
        ...

    def wake_up(self) -> None:
        """Re-allocate what `sleep` freed."""
        ...

    def flush_cache(self) -> None:
        """Drop any cached prefixes / KV state (weights changed)."""
        ...


@runtime_checkable
class SessionEngine(RolloutEngine, Protocol):
    """A `RolloutEngine` that keeps samples between turns: `generate(keep=True)` returns each sample with a
    `Session` holding its KV-cache slot; `continue_` appends an observation's tokens, prefills only what the cache
    does not hold yet, and samples the next turn; `release` frees the slots. Kept slots count against the engine's
    capacity until released."""

    supports_sessions: bool
    free_slots: int
    """Samples that can be kept now (slots not held by open sessions): a `keep=True` call needs one per sample."""

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, seeds: Sequence[int] | None = None, *,
        keep: bool = False,
    ) -> list[Generation]:
        """As `RolloutEngine.generate`; with `keep` every finished sample keeps its slot (`Generation.session`)."""
        ...

    def continue_(
        self, sessions: Sequence[Session], appended: Sequence[Sequence[int]], sampling: SamplingParams,
        seeds: Sequence[int] | None = None, *, keep: bool = True,
    ) -> list[Generation]:
        """Append `appended[i]` to `sessions[i]` and sample one more turn of it (`sampling.n` is ignored: one
        sample per session); results ordered by session. A turn that does not fit the engine's sequence length
        finishes with "length". `keep=False` releases each session when its turn ends."""
        ...

    def release(self, sessions: Iterable[Session]) -> None:
        """Free the sessions' slots (closed sessions are skipped)."""
        ...


def supports_sessions(engine: object) -> bool:
    """Whether `engine` implements `SessionEngine` (the capability flag, not just the method names)."""
    return bool(getattr(engine, "supports_sessions", False))


def expand_seeds(n_prompts: int, sampling: SamplingParams, seeds: Sequence[int] | None) -> list[list[int]]:
    """Per-sample seeds `[prompt][sample]` (pure; shared by every engine so seeds mean the same thing).

    `seeds[i]` (one per prompt) gives sample j of prompt i the seed `seeds[i] + j`; otherwise the base
    `sampling.seed` gives `seed + i * n + j`; with neither, fresh random seeds.
    """
    n = sampling.n
    if seeds is not None:
        if len(seeds) != n_prompts:
            raise ValueError(f"got {len(seeds)} seeds for {n_prompts} prompts; pass one seed per prompt")
        return [[int(s) + j for j in range(n)] for s in seeds]
    if sampling.seed is not None:
        return [[sampling.seed + i * n + j for j in range(n)] for i in range(n_prompts)]
    fresh = torch.randint(0, 2**31 - 1, (n_prompts, n)).tolist()
    return fresh
