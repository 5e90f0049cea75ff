"""`RolloutEngine` over SGLang's offline `sglang.Engine` (optional; `pip install rlbench[sglang]`, sglang>=0.5.23).

Held to SGLang 0.5.23's API (paths under `python/sglang/srt/`; docs/rollout.md lists what was checked and
what was never run):
- generate: `input_ids` + one `sampling_params` dict per sample + `return_logprob=True`; each prompt is sent n
  times, each request with its own `sampling_seed` (the radix cache shares the prompt's prefill). SGLang
  honours `sampling_seed` only in its deterministic mode (`sampling/sampling_batch_info.py:128, 157-171`), so a
  seeded call without it is refused unless `allow_unseeded`. Tokens and log-probs come from
  `meta_info["output_token_logprobs"]` (`(logprob, token_id, text)` triples), the finish reason from
  `meta_info["finish_reason"]["type"]`.
- weights: every update runs inside `begin_weight_update()` / `end_weight_update()` (without the session
  `update_weights_from_tensor` answers `(False, msg)`: `managers/scheduler_components/weight_updater.py:232-239,
  309-335`). Every call's `(ok, message)` is checked and a failure raises with SGLang's message; names the
  checkpoint does not have are refused before their bucket is sent (SGLang logs and skips them: `models/qwen3.py:760`);
  the version changes only after the whole update, the session end and the cache flush succeeded. `dtype` is the
  dtype SGLang holds the parameters in (`configs/model_config.py:2284-2329`), so the trainer casts before sending
  and weight-sync verify compares like with like.
- disaggregated weights: the trainer's `ray_weights.BroadcastGroup` is rank 0 of a group SGLang joins with
  `init_weights_update_group` (`init_custom_process_group`, `utils/common.py:2859-2927`; ranks rank_offset + tp_rank,
  `model_executor/model_runner_components/weight_updater.py:124-138`). Each bucket is announced as (names, dtypes,
  shapes, load_format), checked against the checkpoint before SGLang hears of it, and received by
  `update_weights_from_distributed` inside its own session (one broadcast per tensor in `names` order, or one uint8
  `flattened_bucket` buffer: `weight_updater.py:260-310`). SGLang's join and receive block until the trainer's side
  is done, so both run on the adapter's weight thread and return a Future.
- memory: `sleep` releases tags and `wake_up` resumes exactly those (resuming a tag that was not released raises
  `KeyError` in the scheduler, `weight_updater.py:383-390`, which then kills the whole process tree,
  `managers/scheduler.py:6370-6373`, `entrypoints/engine.py:1976-1982`); a `wake_up` without `sleep` does nothing.
- event loop: `sglang.Engine` runs every call with `loop.run_until_complete` on the loop it found or made at
  construction (`entrypoints/engine.py:396, 1403-1414, 1506-1507`), which fails inside a running loop (Jupyter); started
  from inside one, the adapter builds and calls the engine on a thread of its own.

Log-probs: log_softmax(logits / T) of the sampled token, before top-p/top-k (`layers/sampler.py:275, 315`);
greedy: T = 1 (`layers/sampler.py:208-222`), the `Generation` contract.
"""

from __future__ import annotations

import asyncio
import json
import os
import struct
import warnings
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from rlbench.configs import SGLangEngineConfig
from rlbench.engine.protocol import Generation, SamplingParams, WeightBucket, expand_seeds
from rlbench.weights import DTYPE_NAMES, GROUP_NAME, LOAD_FORMAT, check_announcement

__all__ = ["SGLangEngine", "SGLangEngineConfig", "check_model_dir", "checkpoint_weight_shapes", "sglang_load_dtype",
           "to_sglang_params"]

MIN_VERSION = (0, 5, 23)
"""The oldest SGLang whose API this adapter follows (weight-update sessions, `(ok, msg)` returns)."""
_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def _import_sglang():
    try:
        import sglang
    except ImportError as err:  # optional dependency: say which extra installs it
        raise ImportError("the sglang rollout engine needs SGLang: pip install 'rlbench[sglang]' "
                          "(or use the default torch engine, rollout_engine='torch')") from err
    check_version(sglang.__version__)
    return sglang


def check_version(version: str) -> None:
    """Raise ImportError when `version` is older than `MIN_VERSION` (or not a release number)."""
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(version).release
    except InvalidVersion as err:
        raise ImportError(f"sglang.__version__={version!r} is not a version; install sglang>=0.5.23") from err
    if release < MIN_VERSION:
        raise ImportError(f"sglang {version} is older than 0.5.23, whose weight-update API (begin/end_weight_update, "
                          "(ok, message) returns) this adapter follows; pip install 'sglang>=0.5.23'")


def checkpoint_weight_shapes(model_path: str) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of an HF checkpoint directory (its safetensors headers), plus `lm_head.weight`
    when the embeddings are tied (trainers send it; the engine shares it with `embed_tokens`). Whole HF shapes: what
    `update_weights_from_distributed` receives at any TP size (the loaders shard after the receive)."""
    files = [f for f in sorted(os.listdir(model_path)) if f.endswith(".safetensors")]
    if not files:
        raise ValueError(f"{model_path} has no *.safetensors: SGLang needs an HF checkpoint directory")
    shapes = {}
    for file in files:
        with open(os.path.join(model_path, file), "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        shapes |= {name: tuple(entry["shape"]) for name, entry in header.items() if name != "__metadata__"}
    with open(os.path.join(model_path, "config.json"), encoding="utf-8") as f:
        tied = json.load(f).get("tie_word_embeddings")
    if tied and "model.embed_tokens.weight" in shapes:
        shapes["lm_head.weight"] = shapes["model.embed_tokens.weight"]
    return shapes


def check_model_dir(model_path: str | None) -> None:
    """ValueError unless `model_path` is an HF model directory (SGLang loads nothing else)."""
    if model_path is None or not os.path.isfile(os.path.join(model_path, "config.json")):
        raise ValueError(f"sglang model_path={model_path!r} must be an HF model directory (config.json + "
                         "safetensors); a model preset name cannot be loaded by SGLang")


_DTYPES = {"half": torch.float16, "float16": torch.float16, "float": torch.float32, "float32": torch.float32,
           "bfloat16": torch.bfloat16}  # configs/model_config.py:2274-2280


def sglang_load_dtype(model_path: str, dtype: str = "auto") -> torch.dtype:
    """The dtype SGLang holds a checkpoint's parameters in (`configs/model_config.py:2284-2329`): `dtype` unless
    "auto"; else the config's `dtype` / `torch_dtype`, where float32 or none given becomes float16 (bfloat16 for
    Gemma models)."""
    if dtype != "auto":
        if dtype.lower() not in _DTYPES:
            raise ValueError(f"sglang dtype={dtype!r}: SGLang knows auto, {sorted(_DTYPES)}")
        return _DTYPES[dtype.lower()]
    with open(os.path.join(model_path, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config = config.get("text_config") or config  # SGLang reads the text model's config (hf_text_config)
    loaded = _DTYPES.get(config.get("dtype") or config.get("torch_dtype") or "float32", torch.float32)
    if loaded != torch.float32:
        return loaded
    return torch.bfloat16 if str(config.get("model_type", "")).startswith("gemma") else torch.float16


class _EngineThread:
    """Runs `sglang.Engine` (construction and every call) on one thread of its own, whose event loop SGLang
    makes; for callers inside a running event loop, where SGLang's `run_until_complete` fails."""

    def __init__(self, factory):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sglang-engine")
        self._engine = self._pool.submit(factory).result()

    def __getattr__(self, name: str):
        method = getattr(self._engine, name)
        return lambda *args, **kwargs: self._pool.submit(method, *args, **kwargs).result()


def _in_running_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def to_sglang_params(sampling: SamplingParams, seed: int | None) -> dict[str, Any]:
    """Our `SamplingParams` (one sample) -> an SGLang `sampling_params` dict.

    `ignore_eos` means "never stop before max_new_tokens" here; SGLang's own `ignore_eos` still stops on stop
    strings (`managers/schedule_batch.py:1857`), so stops are dropped. `min_new_tokens == max_new_tokens` is the
    same exact-length request. SGLang's `min_new_tokens` sets the stop tokens' logits to -inf
    (`sampling/penaltylib/min_new_tokens.py:65-90`), which biases the log-probs, where the torch engine samples them
    and keeps going; any other `min_new_tokens` is refused.
    """
    exact = sampling.ignore_eos or sampling.min_new_tokens == sampling.max_new_tokens
    if sampling.min_new_tokens and not exact:
        raise ValueError(
            f"min_new_tokens={sampling.min_new_tokens}: SGLang masks the stop tokens until then (log-probs of a "
            "masked distribution); use min_new_tokens=0, or ignore_eos=True / min_new_tokens=max_new_tokens for "
            "exact-length samples")
    params = dict(
        temperature=sampling.temperature, top_p=sampling.top_p,
        top_k=sampling.top_k if sampling.top_k > 0 else -1, max_new_tokens=sampling.max_new_tokens,
        stop=[] if exact else list(sampling.stop), stop_token_ids=[] if exact else list(sampling.stop_token_ids),
        ignore_eos=exact,
    )
    if seed is not None:
        params["sampling_seed"] = seed
    return params


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


def _check(result, call: str) -> None:
    """Raise with SGLang's message unless `result` (an `(ok, message)` pair or an object with `.success`) is ok."""
    ok, message = (result.success, result.message) if hasattr(result, "success") else result
    if not ok:
        raise RuntimeError(f"SGLang {call} failed: {message}")


SESSIONS_REFUSED = ("SGLangEngine has no sessions (generate(keep=True) / continue_ / release); use the torch engine, "
                    "or re-send the whole context to generate() (SGLang's radix cache may reuse its prefix)")


class SGLangEngine:
    """The `RolloutEngine` protocol over `sglang.Engine`.

    Args:
        cfg: how the engine is (or was) started; `cfg.model_path` must be set (the checkpoint whose tensor names
            an update may carry).
        engine: an already constructed `sglang.Engine` started with `cfg` (or an object with its methods, e.g.
            a test double); None starts one.
        weight_shapes: name -> shape of every tensor an update may carry (None: read from `cfg.model_path`).
    """

    def __init__(self, cfg: SGLangEngineConfig, engine: Any = None, weight_shapes: dict | None = None):
        check_model_dir(cfg.model_path)
        if engine is None:
            sglang, kwargs = _import_sglang(), cfg.engine_kwargs(cfg.model_path)
            if _in_running_loop():  # e.g. Jupyter: SGLang's run_until_complete cannot run on that loop
                engine = _EngineThread(lambda: sglang.Engine(**kwargs))
            else:
                engine = sglang.Engine(**kwargs)
        self.cfg = cfg
        self.engine = engine
        self.weight_shapes = dict(weight_shapes if weight_shapes is not None else checkpoint_weight_shapes(cfg.model_path))
        self.weight_version = 0
        self.dtype = sglang_load_dtype(cfg.model_path, str(cfg.extra.get("dtype", "auto")))
        """The dtype of SGLang's parameters; the weight sync casts to it before sending."""
        self._released: list[str] = []
        self._weight_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sglang-weights")
        """Issues SGLang's blocking group join and receive, so the caller can take the trainer's side meanwhile."""
        self._sent: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}  # what the last update carried (for verify)
        self._warned_unseeded = False

    supports_sessions = False
    """No `SessionEngine` sessions: re-send the whole context with `generate` (SGLang's radix cache then reuses the
    cached prefix, though nothing here guarantees it or counts it)."""

    # ------------------------------------------------------------------ generation
    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, seeds: Sequence[int] | None = None, *,
        keep: bool = False,
    ) -> list[Generation]:
        """One SGLang request per sample; results ordered by (prompt_index, sample_index). `keep=True` is refused
        (no sessions).

        Raises:
            ValueError: the call is seeded (`seeds` or `sampling.seed`) but SGLang's deterministic mode is off
                (it would ignore the seeds) and `allow_unseeded` is False.
        """
        if keep:
            raise NotImplementedError(SESSIONS_REFUSED)
        seeded = seeds is not None or sampling.seed is not None
        if seeded and not self.cfg.deterministic:
            if not self.cfg.allow_unseeded:
                raise ValueError(
                    "seeded generate with sglang enable_deterministic_inference=False: SGLang ignores sampling_seed "
                    "outside its deterministic mode (samples would depend on batch composition); set "
                    "enable_deterministic_inference=True (--sglang-enable-deterministic-inference), or "
                    "allow_unseeded=True to sample without the seeds")
            if not self._warned_unseeded:
                warnings.warn("sglang: deterministic inference is off, the per-sample seeds are ignored", stacklevel=2)
                self._warned_unseeded = True
        per_prompt = expand_seeds(len(prompts), sampling, seeds)
        keys = [(i, j) for i in range(len(prompts)) for j in range(sampling.n)]
        outs = self.engine.generate(
            input_ids=[list(prompts[i]) for i, _ in keys],
            sampling_params=[to_sglang_params(sampling, per_prompt[i][j] if self.cfg.deterministic else None)
                             for i, j in keys],
            return_logprob=True,
        )
        if len(outs) != len(keys):
            raise RuntimeError(f"SGLang returned {len(outs)} results for {len(keys)} requests")
        return [from_sglang_output(o, i, j, self.weight_version) for o, (i, j) in zip(outs, keys)]

    def continue_(self, *args, **kwargs) -> list[Generation]:
        """Refused: SGLangEngine has no sessions (`supports_sessions` is False)."""
        raise NotImplementedError(SESSIONS_REFUSED)

    def release(self, *args, **kwargs) -> None:
        """Refused: SGLangEngine has no sessions (`supports_sessions` is False)."""
        raise NotImplementedError(SESSIONS_REFUSED)

    # ------------------------------------------------------------------ weights
    def update_weights(self, buckets: Iterable[WeightBucket], version: int) -> None:
        """Colocated sync: one weight-update session, each bucket through `update_weights_from_tensor`, then one
        cache flush; `weight_version = version` only when all of it succeeded.

        Raises:
            ValueError: a tensor name the checkpoint does not have (nothing of that bucket is sent).
            RuntimeError: SGLang refused a call (its message is included); the engine may hold a mix of old and
                new weights and keeps its old version.
        """
        sent: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}

        def send():
            for bucket in buckets:
                unknown = sorted(name for name, _ in bucket if name not in self.weight_shapes)
                if unknown:
                    raise ValueError(f"weight update names {unknown[:5]} (of {len(unknown)}) are not in the checkpoint "
                                     f"{self.cfg.model_path}; SGLang would skip them silently (name mapping?)")
                _check(self.engine.update_weights_from_tensor(named_tensors=list(bucket), flush_cache=False),
                       "update_weights_from_tensor")
                sent.update((name, (t.dtype, tuple(t.shape))) for name, t in bucket)

        self._in_session(send)
        _check(self.engine.flush_cache(), "flush_cache")
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.ipc_collect()  # free the CUDA IPC handles SGLang opened on our buckets
        self._sent = sent
        self.weight_version = version

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The engine's copy of every tensor the last update sent, by HF name, in the dtype it was sent in (for
        `WeightSyncConfig.verify`). Reads `get_weights_by_name` (`entrypoints/engine.py:1736-1741`), which SGLang
        implements for Llama-family models at TP=1 only (`models/llama.py:819-884`); others answer None.

        Raises:
            RuntimeError: tp_size > 1, or SGLang returned no weights for a name.
        """
        if self.cfg.tp_size > 1:
            raise RuntimeError("weight sync verify with the sglang engine needs tp_size=1: get_weights_by_name returns "
                               "rank-local shards of the fused projections")
        for name, (dtype, shape) in self._sent.items():
            values = self.engine.get_weights_by_name(name, truncate_size=shape[0] if shape else 1)
            if values is None:
                raise RuntimeError(
                    f"weight sync verify: SGLang's get_weights_by_name({name!r}) returned None (SGLang 0.5.23 "
                    "implements it for Llama-family models only, model_executor/model_runner_components/"
                    "weight_exporter.py:169-188); turn weights.verify off for this model")
            yield name, torch.tensor(values, dtype=torch.float32).reshape(shape).to(dtype)

    # ------------------------------------------------------------------ weights, disaggregated
    @property
    def group_ranks(self) -> int:
        """Ranks the engine takes in a weight-broadcast group: one per TP rank (`weight_updater.py:124`)."""
        return self.cfg.tp_size

    def weight_layout(self) -> tuple[dict[str, tuple[int, ...]], str]:
        """(name -> shape, dtype) an announcement must match: the checkpoint's tensors, SGLang's parameter dtype."""
        return self.weight_shapes, DTYPE_NAMES[self.dtype]

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = GROUP_NAME, backend: str = "nccl") -> Future:
        """Disaggregated sync: start joining the trainer's broadcast group (`ray_weights.BroadcastGroup`, rank 0)
        as ranks rank_offset .. rank_offset + tp_size - 1 (SGLang's `init_custom_process_group`).

        SGLang's call returns only once every rank has joined, so it runs on the adapter's weight thread: form the
        trainer's side meanwhile, then `.result(timeout)`, which raises RuntimeError with SGLang's message.
        """
        return self._weight_thread.submit(lambda: _check(self.engine.init_weights_update_group(
            master_address=master_address, master_port=master_port, rank_offset=rank_offset, world_size=world_size,
            group_name=group_name, backend=backend), "init_weights_update_group"))

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        version: int, group_name: str = GROUP_NAME,
                                        load_format: str | None = LOAD_FORMAT) -> Future:
        """Disaggregated sync of one bucket, announced as `ray_weights.announce` does: start SGLang's receive,
        then broadcast (`ray_weights.outgoing`), then `.result(timeout)`.

        The announcement is checked here, before SGLang is called: names and shapes against the checkpoint, dtypes
        against `self.dtype`, the flattened bucket's alignment (a receive that fails before its broadcast leaves
        the trainer waiting). On the weight thread (SGLang's call blocks until every broadcast has arrived):
        `begin_weight_update()`, `update_weights_from_distributed(..., flush_cache=True)`, `end_weight_update()`;
        `weight_version = version` only when all three succeeded.

        Raises:
            ValueError: (here) the announcement does not fit the engine; nothing was sent to SGLang.
            RuntimeError: (from `.result()`) SGLang refused a call; its message is included.
        """
        meta = {"names": list(names), "dtypes": list(dtypes), "shapes": [list(s) for s in shapes],
                "load_format": load_format}
        check_announcement(meta, *self.weight_layout())

        def receive():
            self._in_session(lambda: _check(self.engine.update_weights_from_distributed(
                group_name=group_name, flush_cache=True, **meta), "update_weights_from_distributed"))
            self._sent.update((n, (self.dtype, tuple(s))) for n, s in zip(meta["names"], meta["shapes"]))
            self.weight_version = version

        return self._weight_thread.submit(receive)

    def _in_session(self, body) -> None:
        """`body()` between `begin_weight_update()` and `end_weight_update()`; the session is closed whatever
        happens, and a failing close does not hide the error that came first."""
        _check(self.engine.begin_weight_update(), "begin_weight_update")
        try:
            body()
        except BaseException as err:
            try:
                _check(self.engine.end_weight_update(), "end_weight_update")
            except RuntimeError as end_err:
                err.add_note(f"closing the weight-update session failed too: {end_err}")
            raise
        _check(self.engine.end_weight_update(), "end_weight_update")

    # ------------------------------------------------------------------ memory
    def sleep(self, release_weights: bool = False) -> None:
        """Flush, then release the KV cache (and the CUDA graphs when SGLANG_MEMORY_SAVER_CUDA_GRAPH=1, the only
        case their release frees memory: `model_executor/runner_backend/full_cuda_graph_backend.py:121-124`), and
        the weights when asked. Sleeping twice releases nothing more."""
        if self._released:
            return
        _check(self.engine.flush_cache(), "flush_cache")
        tags = ["kv_cache"]
        if os.environ.get("SGLANG_MEMORY_SAVER_CUDA_GRAPH") == "1":
            tags.append("cuda_graph")
        if release_weights:
            tags.append("weights")
        self.engine.release_memory_occupation(tags=tags)
        self._released = tags

    def wake_up(self) -> None:
        """Resume exactly what `sleep` released (nothing when it was not called)."""
        if not self._released:
            return
        self.engine.resume_memory_occupation(tags=self._released)
        self._released = []

    def flush_cache(self) -> None:
        _check(self.engine.flush_cache(), "flush_cache")

    def shutdown(self) -> None:
        self._weight_thread.shutdown(wait=False, cancel_futures=True)
        self.engine.shutdown()
