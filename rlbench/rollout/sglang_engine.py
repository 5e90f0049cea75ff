"""`RolloutEngine` over SGLang's offline `sglang.Engine` (optional; `pip install rlbench[sglang]`).

Only the request/response translation lives here (pure functions, unit-tested with a fake engine):
- generate: `input_ids` + per-sample `sampling_params` dicts + `return_logprob=True`; each prompt is sent n
  times (one request per sample, each with its own `sampling_seed`; SGLang's radix cache shares the
  prompt's prefill). Tokens and log-probs come from `meta_info.output_token_logprobs`
  (`(logprob, token_id, text)` triples), the finish reason from `meta_info.finish_reason["type"]`.
- colocated weights: `update_weights_from_tensor(named_tensors=bucket, flush_cache=False)` per bucket, then
  one `flush_cache()`; disaggregated: `init_weights_update_group` / `update_weights_from_distributed`
  (the trainer broadcasts over NCCL).
- memory: `release_memory_occupation(tags)` / `resume_memory_occupation(tags)` (needs
  `enable_memory_saver=True`).

Log-prob definition: SGLang reports log-probs of its processed logits; which processing (temperature or
not) depends on the SGLang version and flags. Check the rollout/train log-prob gap metric before trusting
it for TIS/MIS; the torch engine is exact by construction.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlbench.rollout.base import Generation, SamplingParams, WeightBucket, expand_seeds

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


@dataclass
class SGLangEngineConfig:
    """Arguments for `sglang.Engine` (SGLang `ServerArgs` names)."""

    model_path: str
    """Local HF model directory (the trainer's checkpoint format)."""
    tp_size: int = 1
    """Tensor-parallel GPUs per engine."""
    mem_fraction_static: float = 0.6
    """Fraction of GPU memory for weights + KV cache."""
    enable_memory_saver: bool = True
    """Needed for sleep/wake_up (release/resume memory occupation)."""
    random_seed: int = 0
    """Server seed (per-request `sampling_seed` overrides it)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Any other `ServerArgs` field, passed through unchanged."""

    def __post_init__(self) -> None:
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static={self.mem_fraction_static} must be in (0, 1)")
        if self.tp_size < 1:
            raise ValueError(f"tp_size={self.tp_size} must be >= 1")

    def engine_kwargs(self) -> dict[str, Any]:
        return dict(model_path=self.model_path, tp_size=self.tp_size, mem_fraction_static=self.mem_fraction_static,
                    enable_memory_saver=self.enable_memory_saver, random_seed=self.random_seed, **self.extra)


def _import_sglang():
    try:
        import sglang
    except ImportError as err:  # optional dependency: say which extra installs it
        raise ImportError("the sglang rollout engine needs SGLang: pip install 'rlbench[sglang]' "
                          "(or use the default torch engine)") from err
    return sglang


def to_sglang_params(sampling: SamplingParams, seed: int) -> dict[str, Any]:
    """Our `SamplingParams` (one sample) -> an SGLang `sampling_params` dict."""
    return dict(
        temperature=sampling.temperature, top_p=sampling.top_p,
        top_k=sampling.top_k if sampling.top_k > 0 else -1,
        max_new_tokens=sampling.max_new_tokens, min_new_tokens=sampling.min_new_tokens,
        stop=list(sampling.stop), stop_token_ids=list(sampling.stop_token_ids),
        ignore_eos=sampling.ignore_eos, sampling_seed=seed,
    )


def from_sglang_output(out: dict, prompt_index: int, sample_index: int, version: int) -> Generation:
    """One SGLang result dict -> `Generation` (tokens and log-probs from `output_token_logprobs`)."""
    meta = out["meta_info"]
    triples = meta.get("output_token_logprobs") or []
    tokens = [int(t[1]) for t in triples]
    if not triples and out.get("output_ids"):
        raise ValueError("SGLang returned tokens without log-probs; generate must pass return_logprob=True")
    reason = meta.get("finish_reason") or {"type": "abort"}
    kind = reason["type"] if isinstance(reason, dict) else str(reason)
    if kind not in _FINISH:
        raise ValueError(f"unknown SGLang finish_reason {reason!r}; expected type stop/length/abort")
    return Generation(prompt_index, tokens, [float(t[0]) for t in triples], _FINISH[kind], version, sample_index)


class SGLangEngine:
    """The `RolloutEngine` protocol over `sglang.Engine`.

    Args:
        cfg: how to start the engine (ignored when `engine` is given).
        engine: an already constructed `sglang.Engine` (or any object with its methods, e.g. a test fake).
    """

    def __init__(self, cfg: SGLangEngineConfig | None = None, engine: Any = None):
        if engine is None:
            if cfg is None:
                raise ValueError("pass SGLangEngineConfig(model_path=...) or a ready sglang.Engine as engine=")
            engine = _import_sglang().Engine(**cfg.engine_kwargs())
        self.engine = engine
        self.weight_version = 0
        self._released: list[str] | None = None

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, seeds: Sequence[int] | None = None
    ) -> list[Generation]:
        """One SGLang request per sample; results ordered by (prompt_index, sample_index)."""
        per_prompt = expand_seeds(len(prompts), sampling, seeds)
        keys = [(i, j) for i in range(len(prompts)) for j in range(sampling.n)]
        outs = self.engine.generate(
            input_ids=[list(prompts[i]) for i, _ in keys],
            sampling_params=[to_sglang_params(sampling, per_prompt[i][j]) for i, j in keys],
            return_logprob=True,
        )
        if len(outs) != len(keys):
            raise RuntimeError(f"SGLang returned {len(outs)} results for {len(keys)} requests")
        return [from_sglang_output(o, i, j, self.weight_version) for o, (i, j) in zip(outs, keys)]

    def update_weights(self, buckets: Iterable[WeightBucket], version: int) -> None:
        """Colocated sync: each bucket through `update_weights_from_tensor`, then one cache flush."""
        for bucket in buckets:
            self.engine.update_weights_from_tensor(named_tensors=list(bucket), flush_cache=False)
        self.engine.flush_cache()
        self.weight_version = version

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "rlbench", backend: str = "nccl") -> None:
        """Disaggregated sync: join the trainer's NCCL group (the trainer is rank 0)."""
        self.engine.init_weights_update_group(master_address=master_address, master_port=master_port,
                                              rank_offset=rank_offset, world_size=world_size,
                                              group_name=group_name, backend=backend)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        version: int, group_name: str = "rlbench") -> None:
        """Receive one broadcast bucket from the trainer; `version` is set after it."""
        self.engine.update_weights_from_distributed(names=names, dtypes=dtypes, shapes=shapes,
                                                    group_name=group_name, flush_cache=True)
        self.weight_version = version

    def sleep(self, release_weights: bool = False) -> None:
        """Flush, then release the KV cache (+ CUDA graphs), and the weights when asked."""
        self.engine.flush_cache()
        self._released = None if release_weights else ["kv_cache", "cuda_graph"]
        self.engine.release_memory_occupation(tags=self._released)

    def wake_up(self) -> None:
        self.engine.resume_memory_occupation(tags=self._released)
        self._released = None

    def flush_cache(self) -> None:
        self.engine.flush_cache()

    def shutdown(self) -> None:
        self.engine.shutdown()
