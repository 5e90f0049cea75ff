"""A test double of `sglang.Engine` 0.5.23 that keeps its contract (no sglang needed), written from the 0.5.23
wheel's source; paths under python/sglang/srt/. `FakeSGLang` runs in the test's process; `SchedulerProcess` runs
it in a child process, as SGLang runs its scheduler, so its weight-update group really forms and receives over gloo.
"""

from __future__ import annotations

import datetime
import multiprocessing
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    Backend,
    PrefixStore,
    _new_process_group_helper,
    _world,
    rendezvous,
)

EMBED, NORM = "model.embed_tokens.weight", "model.norm.weight"
ALL_TAGS = ["kv_cache", "weights", "cuda_graph"]  # srt/constants.py:2-10 (GPU_MEMORY_ALL_TYPES)
GROUP_TIMEOUT_S = 10.0
"""The fake's rendezvous and broadcast timeout (SGLang passes none: torch's default of 30 minutes)."""


class SchedulerDied(RuntimeError):
    """What an exception in SGLang's scheduler process amounts to: it SIGQUITs its parent, whose handler kills
    the whole process tree, the caller included (managers/scheduler.py:6369-6372, entrypoints/engine.py:1976-1982)."""


@dataclass
class FlushCacheReqOutput:  # managers/io_struct.py:1859-1861; what Engine.flush_cache returns (engine.py:1506-1507)
    success: bool
    message: str = ""


def init_custom_process_group(backend, init_method, world_size, rank, group_name, timeout):
    """SGLang's group formation (utils/common.py:2859-2927) for `init_method` given: a rendezvous, a
    `PrefixStore(group_name)`, `_new_process_group_helper`, identity group ranks."""
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      backend_options=None, timeout=timeout, device_id=None)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def empty_flattened_bucket(names, dtypes, shapes) -> tuple[torch.Tensor, list]:
    """`FlattenedTensorBucket.empty` (weight_sync/tensor_bucket.py:86-112): a uint8 buffer and where each tensor
    lies; a negative dimension, an unaligned offset or no tensor at all raise before anything is received."""
    metadata, offset = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype)
        shape = torch.Size(shape)
        if any(dim < 0 for dim in shape):
            raise ValueError(f"Negative dimension in received tensor {name}: {shape}")
        if offset % dtype.itemsize:
            raise ValueError(f"Unaligned received tensor {name}: byte offset {offset}, dtype {dtype}")
        size = shape.numel() * dtype.itemsize
        metadata.append((name, shape, dtype, offset, offset + size))
        offset += size
    if not metadata:
        raise ValueError("Cannot create empty tensor bucket")
    return torch.empty(offset, dtype=torch.uint8), metadata


class FakeSGLang:
    """`sglang.Engine` 0.5.23 as the adapter sees it.

    - weight updates need an open session: `update_weights_from_tensor` / `_from_distributed` answer
      `(False, msg)` outside `begin_weight_update()` / `end_weight_update()`, which answer `(False, msg)` when
      the session is already open / not open (managers/scheduler_components/weight_updater.py:187-197, 232-239,
      309-335; the tokenizer side returns the `(success, message)` pair: managers/tokenizer_control_mixin.py:485-501,
      503-537, 563-597).
    - a name the model does not have is logged and skipped, and the update still succeeds (models/qwen3.py:753-760).
    - `release_memory_occupation(tags)` adds tags (None or [] = all) to a set; `resume_memory_occupation` removes
      each, so resuming a tag that was not released raises KeyError in the scheduler (weight_updater.py:337-390).
    - `sampling_seed` is used only with deterministic inference on (sampling/sampling_batch_info.py:128, 157-171);
      otherwise the draw depends on the batch (here: the request's position in the batch).
    - `get_weights_by_name(name, truncate_size)` returns `weight.float().tolist()[:truncate_size]`, the embeddings
      for a tied lm_head, or None for models without it (models/llama.py:819-884, Qwen3 has none:
      model_executor/model_runner_components/weight_exporter.py:169-188).
    - every parameter is held in the model's load dtype (configs/model_config.py:2284-2329; the fixture's
      checkpoint says bfloat16) and a loaded tensor is cast into it (`param.data.copy_`).
    - the disaggregated path, with real collectives (gloo here): `init_weights_update_group` joins as rank
      rank_offset + tp_rank with `init_custom_process_group` and answers `(ok, msg)`
      (model_executor/model_runner_components/weight_updater.py:100-144); `update_weights_from_distributed`
      (scheduler_components/weight_updater.py:187-230) checks the session, receives (model runner :260-310: one
      async broadcast per tensor in `names` order, or one uint8 `flattened_bucket` buffer), where any error is
      `(False, "Failed to receive weights: ...")`, then loads (:324-341), where any error is
      `(False, "Failed to update parameter online: ...")`.
    """

    def __init__(self, deterministic: bool = True, exports_weights: bool = True, dtype=torch.bfloat16,
                 tp_rank: int = 0):
        self.deterministic, self.exports_weights, self.tp_rank = deterministic, exports_weights, tp_rank
        self.weights = {EMBED: torch.zeros(4, 2, dtype=dtype), NORM: torch.ones(2, dtype=dtype)}
        self.session_open = False
        self.offload_tags: set[str] = set()
        self.groups: dict[str, dist.ProcessGroup] = {}  # the model runner's `_model_update_group`
        self.calls: list[tuple] = []
        self.skipped: list[str] = []
        self.refuse_next: str | None = None  # a loader failure message for the next weight load

    def generate(self, input_ids, sampling_params, return_logprob=False):
        self.calls.append(("generate", input_ids, sampling_params, return_logprob))
        if self.offload_tags & {"kv_cache", "weights"}:
            raise RuntimeError("generate while memory is released")
        outs = []
        for position, p in enumerate(sampling_params):
            draw = p.get("sampling_seed", 42) if self.deterministic else position
            toks = [draw % 100, int(self.weights[NORM].sum())]
            kind = "length" if p["max_new_tokens"] == 2 else "stop"
            outs.append({"text": "..", "output_ids": toks, "meta_info": {
                "output_token_logprobs": [(-0.5, toks[0], None), (-1.25, toks[1], None)],
                "finish_reason": {"type": kind, "matched": 7} if kind == "stop" else {"type": kind, "length": 2},
            }})
        return outs

    def begin_weight_update(self, selector: str = "all"):
        self.calls.append(("begin_weight_update",))
        if self.session_open:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self.session_open = True
        return True, "Success"

    def end_weight_update(self):
        self.calls.append(("end_weight_update",))
        if not self.session_open:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.session_open = False
        return True, "Success"

    def _load(self, named_tensors) -> None:
        """The model's `load_weights` through `default_weight_loader` (model_loader/weight_utils.py:1574-1586):
        assert the shape, `param.data.copy_(tensor)`; unknown names skipped."""
        if self.refuse_next is not None:
            message, self.refuse_next = self.refuse_next, None
            raise RuntimeError(message)
        for name, tensor in named_tensors:
            if name in self.weights:
                param = self.weights[name]
                assert param.size() == tensor.size(), f"Attempted to load weight ({tensor.size()}) into parameter ({param.size()})"
                param.copy_(tensor)
            elif name != "lm_head.weight":  # tied: SGLang's lm_head is the embedding
                self.skipped.append(name)  # logger.warning(f"Parameter {name} not found in params_dict")

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append(("update_weights_from_tensor", [n for n, _ in named_tensors], flush_cache))
        if not self.session_open:
            return False, ("update_weights_from_tensor must run between begin_weight_update() and "
                           "end_weight_update()")
        try:
            self._load(named_tensors)
        except Exception as e:
            return False, str(e)
        return True, "Success"

    def flush_cache(self):
        self.calls.append(("flush_cache",))
        return FlushCacheReqOutput(success=True)

    def get_weights_by_name(self, name: str, truncate_size: int = 100):
        if not self.exports_weights:
            return None
        weight = self.weights[EMBED if name == "lm_head.weight" else name]
        return weight.cpu().to(torch.float32).numpy().tolist()[:truncate_size]

    def release_memory_occupation(self, tags=None):
        self.calls.append(("release_memory_occupation", tags))
        self.offload_tags.update(tags or ALL_TAGS)

    def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume_memory_occupation", tags))
        for tag in tags or ALL_TAGS:
            if tag not in self.offload_tags:
                raise SchedulerDied(f"KeyError: {tag!r} (resume of a tag that was not released)")
            self.offload_tags.remove(tag)

    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size, group_name,
                                  backend="nccl"):
        self.calls.append(("init_weights_update_group", group_name, world_size))
        rank = rank_offset + self.tp_rank
        try:
            self.groups[group_name] = init_custom_process_group(
                backend=backend, init_method=f"tcp://{master_address}:{master_port}", world_size=world_size,
                rank=rank, group_name=group_name, timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
        except Exception as e:  # SGLang answers every failure with its message
            return False, f"Failed to initialize custom process group: {e}."
        return True, "Succeeded to initialize custom process group."

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name="weight_update_group",
                                        flush_cache=True, load_format=None):
        self.calls.append(("update_weights_from_distributed", names, shapes, load_format))
        if not self.session_open:
            return False, ("update_weights_from_distributed must run between begin_weight_update() and "
                           "end_weight_update()")
        try:
            weights = self._receive(names, dtypes, shapes, group_name, load_format)
        except Exception as e:
            return False, f"Failed to receive weights: {e}"
        try:
            self._load(weights)
        except Exception as e:
            return False, (f"Failed to update parameter online: {e}. The full weights of the ModelRunner are "
                           "partially updated. Please discard the whole weights.")
        return True, "Succeeded to update parameter online."

    def _receive(self, names, dtypes, shapes, group_name, load_format):
        """model_executor/model_runner_components/weight_updater.py:260-310."""
        assert group_name in self.groups, (f"Group {group_name} not in {list(self.groups)}. "
                                           "Please call `init_weights_update_group` first.")
        group = self.groups[group_name]
        if load_format == "flattened_bucket":
            buffer, metadata = empty_flattened_bucket(names, dtypes, shapes)
            dist.broadcast(buffer, src=0, group=group)
            return [(name, buffer[start:end].view(dtype).reshape(shape)) for name, shape, dtype, start, end in metadata]
        weights, handles = [], []
        for name, dtype, shape in zip(names, dtypes, shapes):
            weight = torch.empty(shape, dtype=getattr(torch, dtype))
            handles.append(dist.broadcast(weight, src=0, group=group, async_op=True))
            weights.append((name, weight))
        for handle in handles:
            handle.wait()
        return weights

    def state(self) -> dict:
        """(test only) the weights, the session flag and the calls, to read from the parent process."""
        return {"weights": {n: t.clone() for n, t in self.weights.items()}, "session_open": self.session_open,
                "calls": list(self.calls), "ranks": {n: (g.rank(), g.size()) for n, g in self.groups.items()}}

    def shutdown(self):
        self.calls.append(("shutdown",))


class Engine(FakeSGLang):
    """`sglang.Engine(**server_args)` as the adapter starts it (`SGLangEngineConfig.engine_kwargs`), over FakeSGLang
    in the caller's process, holding the checkpoint's tensors as stored (the test checkpoints store SGLang's load
    dtype). What a fake `sglang` package on a Ray actor's path exports (`write_sglang_package`). One process joins
    the weight group as one rank, so only tp_size=1."""

    def __init__(self, model_path: str, tp_size: int = 1, enable_deterministic_inference: bool = False, **server_args):
        import glob

        from safetensors.torch import load_file

        if tp_size != 1:
            raise ValueError(f"the fake sglang.Engine runs one process, so tp_size=1 (got {tp_size})")
        super().__init__(deterministic=enable_deterministic_inference)
        self.weights = {n: t for f in sorted(glob.glob(f"{model_path}/*.safetensors")) for n, t in load_file(f).items()}
        self.server_args = dict(model_path=model_path, tp_size=tp_size,
                                enable_deterministic_inference=enable_deterministic_inference, **server_args)


def write_sglang_package(directory) -> None:
    """A package `sglang` (version 0.5.23) in `directory` whose `Engine` is `Engine` above: put `directory` on a
    process's PYTHONPATH and the adapter's own `import sglang` finds it."""
    import os

    os.makedirs(os.path.join(directory, "sglang"), exist_ok=True)
    with open(os.path.join(directory, "sglang", "__init__.py"), "w", encoding="utf-8") as f:
        f.write(f"import sys\nsys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
                "from fake_sglang import Engine  # noqa: E402\n__version__ = '0.5.23'\n")


def _serve(conn, kwargs: dict) -> None:
    """The child process: one FakeSGLang; each request `(method, args, kwargs)` is answered `("ok", result)` or
    `("raise", repr(error))`; `("reset", (), kwargs)` starts a fresh FakeSGLang, None ends the loop."""
    torch.set_num_threads(1)
    engine = FakeSGLang(**kwargs)
    while (request := conn.recv()) is not None:
        method, args, kw = request
        if method == "reset":
            engine = FakeSGLang(**kw)
            conn.send(("ok", None))
            continue
        if method == "set":
            engine.__dict__.update(kw)
            conn.send(("ok", None))
            continue
        try:
            conn.send(("ok", getattr(engine, method)(*args, **kw)))
        except Exception as e:
            conn.send(("raise", repr(e)))


class SchedulerProcess:
    """FakeSGLang in a child process, reached like SGLang's scheduler: every method call is a request and its
    reply, blocking the caller until the child has finished (a receive ends when the broadcasts have arrived).
    Every wait has `timeout_s`."""

    def __init__(self, timeout_s: float = 30.0, **kwargs):
        ctx = multiprocessing.get_context("spawn")
        self.timeout_s, self._lock = timeout_s, threading.Lock()
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, kwargs), daemon=True, name="fake-sglang-scheduler")
        self._proc.start()

    def call(self, method: str, *args, **kwargs):
        with self._lock:
            self._conn.send((method, args, kwargs))
            if not self._conn.poll(self.timeout_s):
                raise TimeoutError(f"fake SGLang scheduler: no answer to {method} within {self.timeout_s}s")
            kind, value = self._conn.recv()
        if kind == "raise":
            raise SchedulerDied(value)
        return value

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)
        return lambda *args, **kwargs: self.call(method, *args, **kwargs)

    def close(self) -> None:
        self._conn.send(None)
        self._proc.join(timeout=self.timeout_s)
        if self._proc.is_alive():
            self._proc.kill()
