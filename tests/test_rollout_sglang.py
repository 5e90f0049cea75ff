"""SGLang engine translation, against a fake `sglang.Engine` (no sglang needed)."""

from __future__ import annotations

import builtins

import pytest
import torch

from rlbench.rollout import SamplingParams
from rlbench.rollout.sglang_engine import SGLangEngine, SGLangEngineConfig, to_sglang_params


class FakeSGLang:
    """Records calls; answers like `sglang.Engine.generate(input_ids=..., return_logprob=True)`."""

    def __init__(self):
        self.calls = []

    def generate(self, input_ids, sampling_params, return_logprob):
        self.calls.append(("generate", input_ids, sampling_params, return_logprob))
        outs = []
        for ids, p in zip(input_ids, sampling_params):
            toks = [p["sampling_seed"] % 100, len(ids)]
            kind = "length" if p["max_new_tokens"] == 2 else "stop"
            outs.append({"text": "..", "output_ids": toks, "meta_info": {
                "output_token_logprobs": [(-0.5, toks[0], None), (-1.25, toks[1], None)],
                "finish_reason": {"type": kind, "matched": 7} if kind == "stop" else {"type": kind, "length": 2},
            }})
        return outs

    def __getattr__(self, name):
        def record(*args, **kwargs):
            self.calls.append((name, args, kwargs))
        return record


def test_generate_translates_requests_and_responses():
    fake = FakeSGLang()
    engine = SGLangEngine(engine=fake)
    sampling = SamplingParams(temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=2, n=2, stop=["</a>"],
                              stop_token_ids=[7])
    out = engine.generate([[1, 2, 3], [4]], sampling, seeds=[10, 20])
    _, ids, params, logprob = fake.calls[0]
    assert logprob is True and ids == [[1, 2, 3], [1, 2, 3], [4], [4]]
    assert [p["sampling_seed"] for p in params] == [10, 11, 20, 21]
    assert params[0] == dict(temperature=0.7, top_p=0.9, top_k=-1, max_new_tokens=2, min_new_tokens=0,
                             stop=["</a>"], stop_token_ids=[7], ignore_eos=False, sampling_seed=10)
    assert [(g.prompt_index, g.sample_index) for g in out] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert out[1].token_ids == [11, 3] and out[1].log_probs == [-0.5, -1.25]
    assert out[3].token_ids == [21, 1] and all(g.finish_reason == "length" for g in out)
    stop = engine.generate([[5]], SamplingParams(max_new_tokens=3, seed=0))[0]
    assert stop.finish_reason == "stop" and stop.weight_version == 0


def test_weights_and_memory_calls():
    fake = FakeSGLang()
    engine = SGLangEngine(engine=fake)
    buckets = [[("model.embed_tokens.weight", torch.zeros(2))], [("lm_head.weight", torch.ones(2))]]
    engine.update_weights(buckets, version=3)
    names = [c[0] for c in fake.calls]
    assert names == ["update_weights_from_tensor", "update_weights_from_tensor", "flush_cache"]
    assert fake.calls[0][2]["flush_cache"] is False and engine.weight_version == 3
    fake.calls.clear()
    engine.sleep()
    engine.wake_up()
    engine.sleep(release_weights=True)
    engine.wake_up()
    assert [(c[0], c[2].get("tags", "-")) for c in fake.calls] == [
        ("flush_cache", "-"), ("release_memory_occupation", ["kv_cache", "cuda_graph"]),
        ("resume_memory_occupation", ["kv_cache", "cuda_graph"]),
        ("flush_cache", "-"), ("release_memory_occupation", None), ("resume_memory_occupation", None)]
    fake.calls.clear()
    engine.init_weights_update_group("10.0.0.1", 29500, rank_offset=1, world_size=2)
    engine.update_weights_from_distributed(["w"], ["bfloat16"], [[2, 2]], version=4)
    assert fake.calls[0][2]["world_size"] == 2 and fake.calls[1][2]["shapes"] == [[2, 2]]
    assert engine.weight_version == 4


def test_missing_sglang_names_the_extra(monkeypatch):
    real_import = builtins.__import__

    def no_sglang(name, *args, **kwargs):
        if name == "sglang":
            raise ImportError("No module named 'sglang'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_sglang)
    with pytest.raises(ImportError, match=r"rlbench\[sglang\]"):
        SGLangEngine(SGLangEngineConfig(model_path="/nowhere"))


def test_bad_finish_reason_is_loud():
    class Weird(FakeSGLang):
        def generate(self, input_ids, sampling_params, return_logprob):
            return [{"meta_info": {"output_token_logprobs": [], "finish_reason": {"type": "timeout"}}}]

    with pytest.raises(ValueError, match="finish_reason"):
        SGLangEngine(engine=Weird()).generate([[1]], SamplingParams(max_new_tokens=2))
    assert to_sglang_params(SamplingParams(top_k=5), 1)["top_k"] == 5
