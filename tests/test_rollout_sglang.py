"""The SGLang adapter against a test double of `sglang.Engine` that keeps SGLang 0.5.23's contract (no sglang needed)."""

from __future__ import annotations

import asyncio
import builtins
import json
import socket
import threading
import types
import uuid

import pytest
import torch
from fake_sglang import EMBED, GROUP_TIMEOUT_S, NORM, FakeSGLang, SchedulerDied, SchedulerProcess
from safetensors.torch import save_file

from rlbench.configs import RunConfig, SGLangEngineConfig, WeightSyncConfig
from rlbench.configs.cluster import ClusterConfig
from rlbench.configs.data import DataConfig
from rlbench.engine import SamplingParams, sglang_engine
from rlbench.engine.sglang_engine import SGLangEngine, sglang_load_dtype, to_sglang_params
from rlbench.orchestration.ray_weights import (
    BroadcastGroup,
    announce,
    check_announcement,
    outgoing,
    push_broadcast,
)
from rlbench.weights import WeightSync


@pytest.fixture
def model_dir(tmp_path):
    save_file({EMBED: torch.zeros(4, 2, dtype=torch.bfloat16), NORM: torch.ones(2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": True, "torch_dtype": "bfloat16"}))
    return str(tmp_path)


def make(model_dir, fake=None, **cfg):
    fake = fake or FakeSGLang(deterministic=cfg.get("enable_deterministic_inference", True))
    return SGLangEngine(SGLangEngineConfig(model_path=model_dir, **cfg), engine=fake), fake


def new_weights():
    embed = torch.full((4, 2), 0.5, dtype=torch.bfloat16)
    return [[(EMBED, embed)], [(NORM, torch.full((2,), 3.0)), ("lm_head.weight", embed)]]  # tied: the same tensor


def test_generate_translates_requests_and_responses(model_dir):
    engine, fake = make(model_dir)
    sampling = SamplingParams(temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=2, n=2, stop=["</a>"],
                              stop_token_ids=[7])
    out = engine.generate([[1, 2, 3], [4]], sampling, seeds=[10, 20])
    _, ids, params, logprob = fake.calls[0]
    assert logprob is True and ids == [[1, 2, 3], [1, 2, 3], [4], [4]]
    assert [p["sampling_seed"] for p in params] == [10, 11, 20, 21]
    assert params[0] == dict(temperature=0.7, top_p=0.9, top_k=-1, max_new_tokens=2, stop=["</a>"],
                             stop_token_ids=[7], ignore_eos=False, sampling_seed=10)
    assert [(g.prompt_index, g.sample_index) for g in out] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert out[1].token_ids == [11, 2] and out[1].log_probs == [-0.5, -1.25]
    assert out[3].token_ids == [21, 2] and all(g.finish_reason == "length" for g in out)
    stop = engine.generate([[5]], SamplingParams(max_new_tokens=3, seed=0))[0]
    assert stop.finish_reason == "stop" and stop.weight_version == 0


def test_weight_update_runs_in_a_session_and_changes_what_is_sampled(model_dir):
    engine, fake = make(model_dir)
    assert engine.generate([[1]], SamplingParams(max_new_tokens=2, seed=0))[0].token_ids == [0, 2]
    engine.update_weights(new_weights(), version=3)
    assert [c[0] for c in fake.calls[1:]] == ["begin_weight_update", "update_weights_from_tensor",
                                              "update_weights_from_tensor", "end_weight_update", "flush_cache"]
    assert fake.calls[2][2] is False and not fake.session_open and fake.skipped == []
    assert torch.equal(fake.weights[EMBED], torch.full((4, 2), 0.5, dtype=torch.bfloat16))
    gen = engine.generate([[1]], SamplingParams(max_new_tokens=2, seed=0))[0]
    assert gen.token_ids == [0, 6] and gen.weight_version == 3 and engine.weight_version == 3


def test_a_refused_update_raises_with_sglangs_message_and_keeps_the_version(model_dir):
    engine, fake = make(model_dir)
    fake.refuse_next = "Failed to update parameter online: shape mismatch"
    with pytest.raises(RuntimeError, match="update_weights_from_tensor failed: Failed to update parameter online"):
        engine.update_weights(new_weights(), version=1)
    assert engine.weight_version == 0 and not fake.session_open  # the session is closed again
    fake.session_open = True  # a session left open elsewhere: begin refuses, nothing is sent
    with pytest.raises(RuntimeError, match="begin_weight_update failed: a weight-update session is already open"):
        engine.update_weights(new_weights(), version=1)
    assert engine.weight_version == 0 and fake.calls[-1] == ("begin_weight_update",)


def test_a_failing_session_end_does_not_hide_the_updates_error(model_dir):
    engine, fake = make(model_dir)
    fake.refuse_next = "Failed to update parameter online: shape mismatch"
    real_end = fake.end_weight_update

    def end_refused():
        real_end()
        return False, "end_weight_update: finalize failed"

    fake.end_weight_update = end_refused
    with pytest.raises(RuntimeError, match="update_weights_from_tensor failed: .*shape mismatch") as raised:
        engine.update_weights(new_weights(), version=1)
    assert raised.value.__notes__ == [
        "closing the weight-update session failed too: SGLang end_weight_update failed: end_weight_update: finalize failed"]
    assert engine.weight_version == 0 and not fake.session_open


def test_weights_are_cast_to_sglangs_dtype_before_sending_so_verify_compares_like_with_like(model_dir):
    engine, fake = make(model_dir)
    assert engine.dtype == torch.bfloat16  # the checkpoint's torch_dtype, as SGLang's dtype="auto" loads it

    class Fp32Backend:  # a trainer holding fp32 weights; it sends in the dtype the sync asks for
        asked: list = []

        def named_weights_for_sync(self, bucket_bytes, dtype):
            self.asked.append(dtype)
            weights = {EMBED: torch.full((4, 2), 0.1), NORM: torch.full((2,), 1.1)}  # not bf16 values
            yield [(name, t if dtype is None else t.to(dtype)) for name, t in weights.items()]

    backend = Fp32Backend()
    metrics = WeightSync(WeightSyncConfig(verify=True), backend, engine).push(version=1)
    assert metrics["weights/verified"] == 1.0 and backend.asked == [torch.bfloat16]
    assert fake.weights[NORM].tolist() == [1.1015625, 1.1015625] and engine.weight_version == 1  # bf16(1.1)


def test_sglang_load_dtype_follows_model_config(tmp_path):
    def checkpoint(name, config):
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps(config))
        return str(path)

    assert sglang_load_dtype(checkpoint("bf16", {"dtype": "bfloat16"})) == torch.bfloat16
    assert sglang_load_dtype(checkpoint("fp32", {"torch_dtype": "float32"})) == torch.float16  # SGLang's downcast
    assert sglang_load_dtype(checkpoint("none", {})) == torch.float16
    assert sglang_load_dtype(checkpoint("gemma", {"model_type": "gemma2", "torch_dtype": "float32"})) == torch.bfloat16
    assert sglang_load_dtype(checkpoint("vlm", {"text_config": {"torch_dtype": "bfloat16"}})) == torch.bfloat16
    assert sglang_load_dtype(checkpoint("set", {"torch_dtype": "bfloat16"}), "float32") == torch.float32
    with pytest.raises(ValueError, match="dtype='fp8'"):
        sglang_load_dtype(tmp_path, "fp8")


class LoopBoundSGLang(FakeSGLang):
    """How `sglang.Engine` uses event loops: `__init__` keeps the running loop, else the thread's current one, else
    makes and sets a new one (entrypoints/engine.py:396, 1403-1414), and every method is
    `self.loop.run_until_complete(...)` (:1506-1507), which raises when that loop is already running (a notebook's)."""

    def __init__(self, **kwargs):
        super().__init__()
        self.kwargs, self.threads = kwargs, set()
        try:
            self.loop = asyncio.get_running_loop()
        except RuntimeError:
            try:
                self.loop = asyncio.get_event_loop_policy().get_event_loop()
            except RuntimeError:
                self.loop = asyncio.new_event_loop()
                asyncio.set_event_loop(self.loop)

    def flush_cache(self):
        async def flush():
            self.threads.add(threading.get_ident())
            return FakeSGLang.flush_cache(self)

        return self.loop.run_until_complete(flush())


def test_an_engine_started_inside_a_running_event_loop_gets_a_thread_of_its_own(model_dir, monkeypatch):
    monkeypatch.setattr(sglang_engine, "_import_sglang", lambda: types.SimpleNamespace(Engine=LoopBoundSGLang))

    async def notebook_cell():
        engine = SGLangEngine(SGLangEngineConfig(model_path=model_dir))
        engine.update_weights(new_weights(), version=1)
        engine.sleep()
        engine.wake_up()
        return engine

    engine = asyncio.run(notebook_cell())
    inner = engine.engine._engine
    assert inner.kwargs["model_path"] == model_dir and engine.weight_version == 1
    assert len(inner.threads) == 1 and threading.get_ident() not in inner.threads  # one thread, not the caller's
    assert [c[0] for c in inner.calls].count("flush_cache") == 2
    engine.engine._pool.submit(inner.loop.close).result()
    plain = SGLangEngine(SGLangEngineConfig(model_path=model_dir))  # no running loop: built and called here
    assert isinstance(plain.engine, LoopBoundSGLang)
    plain.flush_cache()
    assert plain.engine.threads == {threading.get_ident()}
    plain.engine.loop.close()
    asyncio.set_event_loop(None)


def test_unknown_weight_names_are_an_error_before_anything_is_sent(model_dir):
    engine, fake = make(model_dir)
    with pytest.raises(ValueError, match=r"\['model.layers.0.mlp.up.weight'\].*not in the checkpoint"):
        engine.update_weights([[("model.layers.0.mlp.up.weight", torch.ones(2))]], version=1)
    assert "update_weights_from_tensor" not in [c[0] for c in fake.calls] and not fake.session_open
    assert engine.weight_version == 0 and fake.skipped == []
    assert sglang_engine.checkpoint_weight_shapes(model_dir) == {EMBED: (4, 2), NORM: (2,), "lm_head.weight": (4, 2)}


def test_verify_reads_the_engines_weights_back(model_dir):
    engine, fake = make(model_dir)

    class Backend:
        def named_weights_for_sync(self, bucket_bytes, dtype):
            yield from new_weights()

    sync = WeightSync(WeightSyncConfig(verify=True), Backend(), engine)
    assert sync.push(version=2)["weights/verified"] == 1.0 and engine.weight_version == 2
    real_copy = fake.update_weights_from_tensor

    def lossy(named_tensors, **kw):  # an engine that stores something else than it was sent
        return real_copy([(n, t + 1) for n, t in named_tensors], **kw)

    fake.update_weights_from_tensor = lossy
    with pytest.raises(RuntimeError, match="tensors differ after sync"):
        sync.push(version=3)
    fake.exports_weights = False
    with pytest.raises(RuntimeError, match="get_weights_by_name.*returned None"):
        sync.push(version=4)


def test_wake_up_resumes_exactly_what_sleep_released(model_dir, monkeypatch):
    monkeypatch.delenv("SGLANG_MEMORY_SAVER_CUDA_GRAPH", raising=False)
    engine, fake = make(model_dir)
    engine.wake_up()  # the Trainer's first rollout: nothing was released, nothing is resumed
    assert fake.calls == []
    engine.sleep()
    engine.sleep()
    assert fake.offload_tags == {"kv_cache"}
    engine.wake_up()
    engine.wake_up()
    monkeypatch.setenv("SGLANG_MEMORY_SAVER_CUDA_GRAPH", "1")
    engine.sleep(release_weights=True)
    engine.wake_up()
    assert [c for c in fake.calls if c[0] != "flush_cache"] == [
        ("release_memory_occupation", ["kv_cache"]), ("resume_memory_occupation", ["kv_cache"]),
        ("release_memory_occupation", ["kv_cache", "cuda_graph", "weights"]),
        ("resume_memory_occupation", ["kv_cache", "cuda_graph", "weights"])]
    assert fake.offload_tags == set()
    with pytest.raises(SchedulerDied):  # what the old "resume everything" wake_up did to a fresh engine
        fake.resume_memory_occupation(tags=None)


def test_seeds_are_honoured_in_deterministic_mode_or_refused(model_dir):
    engine, _ = make(model_dir)
    sampling = SamplingParams(max_new_tokens=2, n=1)
    alone = engine.generate([[1]], sampling, seeds=[7])[0].token_ids
    batched = engine.generate([[9], [8], [1]], sampling, seeds=[3, 4, 7])[2].token_ids
    assert alone == batched == [7, 2]  # the same seed gives the same sample whatever else is in the batch
    engine, fake = make(model_dir, enable_deterministic_inference=False)
    with pytest.raises(ValueError, match="ignores sampling_seed"):
        engine.generate([[1]], sampling, seeds=[7])
    assert fake.calls == []
    unseeded = engine.generate([[1]], SamplingParams(max_new_tokens=2))  # no seed asked for: fine
    assert "sampling_seed" not in fake.calls[0][2][0] and unseeded[0].token_ids == [0, 2]
    engine, fake = make(model_dir, enable_deterministic_inference=False, allow_unseeded=True)
    with pytest.warns(UserWarning, match="seeds are ignored"):
        engine.generate([[1]], sampling, seeds=[7])
    assert "sampling_seed" not in fake.calls[0][2][0]
    assert SGLangEngineConfig(enable_deterministic_inference=False, rl_on_policy_target="fsdp").engine_kwargs("/m")[
        "enable_deterministic_inference"] is True


def test_exact_length_and_min_new_tokens():
    exact = to_sglang_params(SamplingParams(max_new_tokens=4, ignore_eos=True, stop=["x"], stop_token_ids=[2]), 1)
    assert (exact["ignore_eos"], exact["stop"], exact["stop_token_ids"]) == (True, [], [])
    assert to_sglang_params(SamplingParams(max_new_tokens=4, min_new_tokens=4, stop=["x"]), 1)["ignore_eos"] is True
    with pytest.raises(ValueError, match="masks the stop tokens"):
        to_sglang_params(SamplingParams(max_new_tokens=4, min_new_tokens=2), 1)
    assert to_sglang_params(SamplingParams(top_k=5), None) == dict(
        temperature=1.0, top_p=1.0, top_k=5, max_new_tokens=128, stop=[], stop_token_ids=[], ignore_eos=False)


def test_version_and_missing_sglang(monkeypatch, model_dir):
    sglang_engine.check_version("0.5.23")
    sglang_engine.check_version("0.6.0rc1")
    with pytest.raises(ImportError, match="older than 0.5.23"):
        sglang_engine.check_version("0.5.9")
    real_import = builtins.__import__

    def no_sglang(name, *args, **kwargs):
        if name == "sglang":
            raise ImportError("No module named 'sglang'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_sglang)
    with pytest.raises(ImportError, match=r"rlbench\[sglang\]"):
        SGLangEngine(SGLangEngineConfig(model_path=model_dir))
    with pytest.raises(ValueError, match="HF model directory"):
        SGLangEngine(SGLangEngineConfig(model_path="tiny"))


def test_bad_finish_reason_is_loud(model_dir):
    class Weird(FakeSGLang):
        def generate(self, input_ids, sampling_params, return_logprob=False):
            return [{"meta_info": {"output_token_logprobs": [], "finish_reason": {"type": "timeout"}}}]

    engine, _ = make(model_dir, fake=Weird())
    with pytest.raises(ValueError, match="finish_reason"):
        engine.generate([[1]], SamplingParams(max_new_tokens=2))


def test_run_config_selects_sglang():
    data = DataConfig(path="x.jsonl")
    cfg = RunConfig(data=data, rollout_engine="sglang", sglang=SGLangEngineConfig(mem_fraction_static=0.5))
    assert cfg.sglang.engine_kwargs("/m")["mem_fraction_static"] == 0.5
    with pytest.raises(ValueError, match="did you mean 'sglang'"):
        RunConfig(data=data, rollout_engine="sglng")
    with pytest.raises(ValueError, match="true_on_policy_mode"):
        RunConfig(data=data, rollout_engine="sglang", true_on_policy_mode=True)
    with pytest.raises(ValueError, match="sets \\['tp_size'\\]"):
        SGLangEngineConfig(extra={"tp_size": 2})


def test_run_config_takes_sglang_on_ray_disaggregated_and_refuses_what_cannot_work():
    data = DataConfig(path="x.jsonl")
    tp2 = SGLangEngineConfig(tp_size=2)
    cfg = RunConfig(data=data, rollout_engine="sglang", sglang=tp2,
                    cluster=ClusterConfig(backend="ray", colocate=False, rollout_num_gpus=4, rollout_num_gpus_per_engine=2))
    assert cfg.engine_num_gpus == 2 and cfg.cluster.num_engines == 2
    assert RunConfig(data=data).engine_num_gpus == 1  # the torch engine
    with pytest.raises(ValueError, match=r"rollout_engine='sglang' on Ray runs disaggregated only: .* set colocate=False "
                                         r"with rollout_num_gpus \(--no-colocate --rollout-num-gpus N\), or "
                                         "cluster.backend='local'"):
        RunConfig(data=data, rollout_engine="sglang", cluster=ClusterConfig(backend="ray", colocate=True))
    with pytest.raises(ValueError, match=r"sglang.tp_size=2 puts each SGLang engine on 2 GPUs, but "
                                         r"rollout_num_gpus_per_engine=1; set both to the same value \(--sglang-tp-size 2 "
                                         r"--rollout-num-gpus-per-engine 2\)"):
        RunConfig(data=data, rollout_engine="sglang", sglang=tp2,
                  cluster=ClusterConfig(backend="ray", colocate=False, rollout_num_gpus=2))
    with pytest.raises(ValueError, match=r"weights.verify with sglang.tp_size=2: .* turn weights.verify off"):
        RunConfig(data=data, rollout_engine="sglang", sglang=tp2, weights=WeightSyncConfig(verify=True))
    with pytest.raises(ValueError, match="true_on_policy_mode"):
        RunConfig(data=data, rollout_engine="sglang", true_on_policy_mode=True,
                  cluster=ClusterConfig(backend="ray", colocate=False, rollout_num_gpus=1))


def test_ray_sends_in_sglangs_dtype(model_dir):
    """Before any actor starts, the Ray cluster sets weights.dtype to the dtype SGLang holds the parameters in (its
    broadcast receive takes no other), or refuses another one; the torch engine's config is left as it is."""
    from rlbench.orchestration.ray_cluster import with_engine_weight_dtype

    data, cluster = DataConfig(path="x.jsonl"), ClusterConfig(backend="ray", colocate=False, rollout_num_gpus=1)
    cfg = RunConfig(data=data, rollout_engine="sglang", sglang=SGLangEngineConfig(model_path=model_dir), cluster=cluster)
    assert with_engine_weight_dtype(cfg).weights.dtype == "bfloat16"  # the fixture's config.json
    cast = cfg.replace(weights=WeightSyncConfig(dtype="float32"))
    with pytest.raises(ValueError, match=r"weights.dtype='float32', but SGLang holds .* in bfloat16 .* set "
                                         r"weights.dtype='bfloat16' \(--weights-dtype bfloat16\) or leave it unset"):
        with_engine_weight_dtype(cast)
    assert with_engine_weight_dtype(cast.replace(weights=WeightSyncConfig(dtype="bfloat16"))).weights.dtype == "bfloat16"
    with pytest.raises(ValueError, match="must be an HF model directory"):  # the trainer's preset name
        with_engine_weight_dtype(cfg.replace(sglang=SGLangEngineConfig()))
    torch_cfg = RunConfig(data=data, cluster=cluster)
    assert with_engine_weight_dtype(torch_cfg) is torch_cfg


# ---------------------------------------------------------------------------------------------- disaggregated
# The engine's scheduler is a child process (fake_sglang.SchedulerProcess, as SGLang runs its own); the test's
# process is the trainer: rlbench's BroadcastGroup is rank 0 and sends with ray_weights.outgoing.
WAIT_S = 20.0  # every wait on the engine side; the group itself times out after fake_sglang.GROUP_TIMEOUT_S


@pytest.fixture(scope="module")
def scheduler():
    proc = SchedulerProcess(timeout_s=WAIT_S)
    yield proc
    proc.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def joined(model_dir, scheduler):
    """(adapter over the child's engine, the trainer's BroadcastGroup, the group's name): a fresh group per test."""
    scheduler.reset()
    engine = SGLangEngine(SGLangEngineConfig(model_path=model_dir), engine=scheduler)
    # a fresh name per test: a port number can come back, and a process keeps every group name it created
    name, port = f"rlbench-test-{uuid.uuid4().hex[:12]}", _free_port()
    joining = engine.init_weights_update_group("127.0.0.1", port, rank_offset=1, world_size=2, group_name=name,
                                               backend="gloo")
    group = BroadcastGroup("127.0.0.1", port, 0, 2, torch.device("cpu"), GROUP_TIMEOUT_S, group_name=name)
    joining.result(timeout=WAIT_S)
    return engine, group, name


def _send(engine, group, name, bucket, version, load_format):
    """The trainer's side of one bucket, in the order push_broadcast uses: announce, check, start the engine's
    receive on its thread, broadcast, wait."""
    meta = announce(bucket, load_format)
    tensors = outgoing(bucket, meta)
    receiving = engine.update_weights_from_distributed(version=version, group_name=name, **meta)
    for t in tensors:
        group.broadcast(t, src=0)
    receiving.result(timeout=WAIT_S)
    return meta


def test_the_trainers_group_forms_with_sglangs_rendezvous(joined, scheduler):
    """The trainer's BroadcastGroup and SGLang's init_custom_process_group (PrefixStore(group_name), rank =
    rank_offset + tp_rank) meet. Before, BroadcastGroup had no prefix and the adapter's call blocked its caller."""
    engine, group, name = joined
    assert scheduler.state()["ranks"] == {name: (1, 2)} and group.pg.rank() == 0 and group.pg.size() == 2
    assert engine.group_ranks == 1


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_weights_arrive_bit_exact_per_tensor_and_as_a_flattened_bucket(joined, scheduler, load_format):
    engine, group, name = joined
    gen = torch.Generator().manual_seed(0)
    bucket = [(NORM, torch.randn(2, generator=gen).to(torch.bfloat16)),
              (EMBED, torch.randn(4, 2, generator=gen).to(torch.bfloat16))]
    meta = _send(engine, group, name, bucket, version=5, load_format=load_format)
    state = scheduler.state()
    for n, t in bucket:
        assert torch.equal(state["weights"][n].view(torch.int16), t.view(torch.int16)), n
    received = [c for c in state["calls"] if c[0] == "update_weights_from_distributed"]
    assert received == [("update_weights_from_distributed", meta["names"], meta["shapes"], load_format)]
    assert [c[0] for c in state["calls"]][-3:] == ["begin_weight_update", "update_weights_from_distributed",
                                                   "end_weight_update"]
    assert engine.weight_version == 5 and not state["session_open"]


def test_flattened_bucket_is_ordered_so_sglang_accepts_every_offset():
    bucket = [("a", torch.zeros(3, dtype=torch.bfloat16)), ("b", torch.zeros(2)), ("c", torch.zeros(1, dtype=torch.uint8))]
    meta = announce(bucket)
    assert meta["names"] == ["b", "a", "c"] and meta["dtypes"] == ["float32", "bfloat16", "uint8"]
    check_announcement(meta)
    assert outgoing(bucket, meta)[0].numel() == 2 * 4 + 3 * 2 + 1
    as_given = {"names": ["a", "b"], "dtypes": ["bfloat16", "float32"], "shapes": [[3], [2]], "load_format": "flattened_bucket"}
    with pytest.raises(ValueError, match="b: byte offset 6 .* not a multiple of its itemsize 4"):
        check_announcement(as_given)  # SGLang's FlattenedTensorBucket.empty would raise before receiving


def test_a_wrong_announcement_is_refused_before_any_broadcast(joined, scheduler):
    engine, group, name = joined
    norm = torch.full((2,), 3.0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"model.norm.weight announced with shape \[3\], the engine holds \[2\]"):
        engine.update_weights_from_distributed([NORM], ["bfloat16"], [[3]], version=1, group_name=name)
    with pytest.raises(ValueError, match="announced as float32, the engine holds bfloat16: cast before sending"):
        engine.update_weights_from_distributed([NORM], ["float32"], [[2]], version=1, group_name=name)
    with pytest.raises(ValueError, match=r"is bfloat16 \[2\], announced as bfloat16 \[3\]; nothing was broadcast"):
        outgoing([(NORM, norm)], {"names": [NORM], "dtypes": ["bfloat16"], "shapes": [[3]], "load_format": None})
    assert "begin_weight_update" not in [c[0] for c in scheduler.state()["calls"]]  # SGLang was never called
    _send(engine, group, name, [(NORM, norm)], version=2, load_format=None)  # the group is intact, nothing aborted
    assert scheduler.state()["weights"][NORM].tolist() == [3.0, 3.0] and engine.weight_version == 2


def test_a_refused_distributed_update_raises_with_the_engines_message_and_keeps_the_version(joined, scheduler):
    engine, group, name = joined
    scheduler.set(refuse_next="shape mismatch in qkv_proj")
    with pytest.raises(RuntimeError, match="update_weights_from_distributed failed: Failed to update parameter "
                                           "online: shape mismatch in qkv_proj"):
        _send(engine, group, name, [(NORM, torch.ones(2, dtype=torch.bfloat16))], version=3, load_format=None)
    assert engine.weight_version == 0 and not scheduler.state()["session_open"]
    with pytest.raises(RuntimeError, match="Failed to receive weights: Group other not in"):  # fails before receiving
        engine.update_weights_from_distributed([NORM], ["bfloat16"], [[2]], version=3, group_name="other").result(WAIT_S)
    assert engine.weight_version == 0 and not scheduler.state()["session_open"]


class RayHandle:
    """What push_broadcast sees of an engine actor (`receive_weights.remote(meta, version)`), over the adapter."""

    def __init__(self, engine, group_name):
        self.announced = []

        def remote(meta, version):
            self.announced.append(meta)
            return engine.update_weights_from_distributed(version=version, group_name=group_name, **meta)

        self.receive_weights = types.SimpleNamespace(remote=remote)


def test_the_ray_trainers_sender_feeds_sglang_and_checks_its_layout_first(joined, scheduler):
    engine, group, name = joined
    handle = RayHandle(engine, name)

    def wait(futures):
        return [f.result(timeout=WAIT_S) for f in futures]

    embed, norm = torch.arange(8.0).reshape(4, 2).to(torch.bfloat16), torch.full((2,), -2.5, dtype=torch.bfloat16)
    tally = push_broadcast([[(EMBED, embed)], [(NORM, norm)]], [handle], group, 7, wait, layouts=[engine.weight_layout()])
    state = scheduler.state()
    assert torch.equal(state["weights"][EMBED], embed) and torch.equal(state["weights"][NORM], norm)
    assert tally.num_buckets == 2 and engine.weight_version == 7
    assert [m["load_format"] for m in handle.announced] == ["flattened_bucket"] * 2
    with pytest.raises(ValueError, match="announced as float32, the engine holds bfloat16"):  # an fp32 trainer
        push_broadcast([[(NORM, torch.ones(2))]], [handle], group, 8, wait, layouts=[engine.weight_layout()])
    assert len(handle.announced) == 2 and engine.weight_version == 7  # refused before the engine was told


def test_the_local_trainer_steps_with_sglang_colocated(tmp_path, monkeypatch):
    """`rollout_engine="sglang"` through a whole local `Trainer.step()` (colocated, in this process): the adapter's
    own `import sglang` finds the test double (`fake_sglang.write_sglang_package`); every step syncs the trainer's
    weights into it (verified by reading them back) and the engine samples with them, not with the file's."""
    import math
    import sys
    from dataclasses import replace

    from fake_sglang import write_sglang_package

    from rlbench import Trainer, presets
    from rlbench.configs import EvalConfig, LoggingConfig
    from rlbench.models import build_model

    model = build_model("tiny")
    with torch.no_grad():
        model.model.norm.weight.fill_(0.5)  # the double samples int(sum(norm)) as its 2nd token: 32 here, 64 trained
    model.to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    write_sglang_package(tmp_path / "pkg")
    monkeypatch.syspath_prepend(str(tmp_path / "pkg"))
    monkeypatch.delitem(sys.modules, "sglang", raising=False)
    cfg = presets.cpu_test(model="tiny", workdir=str(tmp_path / "run"), level=1, n_eval=8)
    cfg = cfg.replace(
        rollout_engine="sglang", sglang=SGLangEngineConfig(model_path=str(tmp_path / "hf")),
        data=replace(cfg.data, path=cfg.task.train_path, metadata_key=None),
        rollout=replace(cfg.rollout, rollout_batch_size=4, n_samples_per_prompt=4, max_response_len=8),
        batch=replace(cfg.batch, global_batch_size=16, num_rollout=2, max_tokens_per_gpu=256),
        weights=WeightSyncConfig(verify=True, dtype="bfloat16"), eval=EvalConfig(), logging=LoggingConfig(console=False))
    trainer = Trainer(cfg)
    try:
        history = [trainer.step() for _ in range(2)]
        version = trainer.engine.weight_version
    finally:
        trainer.close()
    assert [h["weights/verified"] for h in history] == [1.0, 1.0]
    assert all(math.isfinite(h["train/loss"]) for h in history)
    assert version == history[-1]["weights/version"] == sum(h["train/optimizer_steps"] for h in history)
    assert {s.tokens[-s.response_length:][1] for s in trainer.last_rollout.samples} == {64}
