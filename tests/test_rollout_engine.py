"""The torch rollout engine on CPU (tiny Qwen3, float32): exactness against HF, seeds, weights, memory."""

from __future__ import annotations

import pytest
import torch

from rlbench.engine import SamplingParams, TorchEngine, TorchEngineConfig
from rlbench.models import build_model

LENGTHS = [3, 7, 12, 5, 9, 1, 6]


pytestmark = pytest.mark.usefixtures("one_thread")


def _prompts(lengths=LENGTHS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in lengths]


def _engine(seed=0, num_slots=3, **kw):
    cfg = TorchEngineConfig(max_seq_len=96, num_slots=num_slots, steps_per_sync=4, **kw.pop("cfg", {}))
    return TorchEngine(build_model("tiny", seed=seed), cfg, **kw)


def _full_forward_logprobs(model, prompt, response, temperature) -> torch.Tensor:
    """Float64 reference: log_softmax(logits / T) of one full forward, gathered at the response tokens."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].double()
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(response)[:, None])[:, 0]


def test_greedy_equals_hf_generate_with_slot_reuse():
    """7 prompts of different lengths through 3 slots (slots are freed and reused) == HF greedy, token for token."""
    engine, ref = _engine(), build_model("tiny", seed=0)
    prompts = _prompts()
    out = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=24))
    assert [g.prompt_index for g in out] == list(range(len(prompts)))
    for prompt, gen in zip(prompts, out):
        hf = ref.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24, min_new_tokens=24,
                          pad_token_id=0)[0, len(prompt):].tolist()
        assert gen.token_ids == hf
        assert gen.finish_reason == "length" and gen.weight_version == 0


def test_logprobs_match_full_forward():
    """Sampled at T=0.7 with top-p: returned logprobs == log_softmax(logits/T) of a full forward (fp32 tight)."""
    engine, ref = _engine(), build_model("tiny", seed=0)
    prompts = _prompts()
    out = engine.generate(prompts, SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=20, n=2, seed=3))
    diffs = torch.cat([
        (_full_forward_logprobs(ref, prompts[g.prompt_index], g.token_ids, 0.7) - torch.tensor(g.log_probs).double()).abs()
        for g in out
    ])
    print(f"logprob |diff| vs full forward: max {diffs.max():.3e} mean {diffs.mean():.3e} over {diffs.numel()} tokens")
    assert len(out) == 2 * len(prompts) and diffs.numel() == 20 * len(out)
    assert diffs.max() < 5e-6


def test_seeded_sampling_independent_of_batch_and_slot():
    """Same (prompt, seed) -> same sample alone, inside another batch, in another slot, or as sample j of n."""
    prompts = _prompts()
    sampling = SamplingParams(temperature=1.0, top_k=20, max_new_tokens=16)
    big = _engine(num_slots=4).generate(prompts, sampling, seeds=[100 + i for i in range(len(prompts))])
    engine = _engine(num_slots=3)
    for i in (5, 0, 3):
        alone = engine.generate([prompts[i]], sampling, seeds=[100 + i])[0]
        assert alone.token_ids == big[i].token_ids and alone.log_probs == pytest.approx(big[i].log_probs, abs=1e-6)
    grouped = engine.generate([prompts[2]], SamplingParams(temperature=1.0, top_k=20, max_new_tokens=16, n=3),
                              seeds=[100])
    assert [g.sample_index for g in grouped] == [0, 1, 2]
    singles = [engine.generate([prompts[2]], sampling, seeds=[100 + j])[0] for j in range(3)]
    assert [g.token_ids for g in grouped] == [g.token_ids for g in singles]
    assert len({tuple(g.token_ids) for g in grouped}) == 3  # different seeds, different samples


def test_update_weights_equals_fresh_engine():
    """In-place update (HF names, buckets, tied lm_head alias included, fused weights) == a fresh engine."""
    engine = _engine(seed=0)
    assert engine.runner.fused  # q/k/v and gate/up are views of the engine's fused tensors
    params = [p.data_ptr() for p in engine.model.parameters()]
    new = build_model("tiny", seed=1)
    named = list(new.state_dict().items())
    assert any(name == "lm_head.weight" for name, _ in named)
    engine.update_weights([named[:5], named[5:]], version=4)
    assert [p.data_ptr() for p in engine.model.parameters()] == params  # no reallocation
    sampling = SamplingParams(temperature=0.8, max_new_tokens=12, seed=7)
    got = engine.generate(_prompts(), sampling)
    want = _engine(seed=1).generate(_prompts(), sampling)
    assert [g.token_ids for g in got] == [g.token_ids for g in want]
    assert all(g.weight_version == 4 for g in got)
    with pytest.raises(ValueError, match="unknown weight"):
        engine.update_weights([[("model.nope.weight", torch.zeros(1))]], version=5)


def test_sleep_wake_round_trip():
    """sleep frees the cache (and weights when asked); wake_up + update_weights restore identical outputs."""
    engine = _engine()
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    sampling = SamplingParams(temperature=0.0, max_new_tokens=10)
    before = [g.token_ids for g in engine.generate(_prompts(), sampling)]
    engine.sleep()
    assert not engine.cache.allocated
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(_prompts(), sampling)
    engine.wake_up()
    assert [g.token_ids for g in engine.generate(_prompts(), sampling)] == before
    engine.sleep(release_weights=True)
    assert all(p.numel() == 0 for p in engine.model.parameters())
    with pytest.raises(RuntimeError, match="wake_up"):
        engine.update_weights([list(state.items())], version=1)
    with pytest.warns(UserWarning, match="update_weights"):
        engine.wake_up()
    engine.update_weights([list(state.items())], version=1)
    engine.flush_cache()
    assert [g.token_ids for g in engine.generate(_prompts(), sampling)] == before


class _CharTokenizer:
    """Token t decodes to one letter; enough for stop-string tests."""

    def decode(self, ids):
        return "".join(chr(97 + t % 26) for t in ids)


def test_stop_ids_stop_strings_and_length():
    prompts = _prompts()[:3]
    tok = _CharTokenizer()
    engine = _engine(tokenizer=tok)
    free = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=16))
    stop_id = free[0].token_ids[5]
    out = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=16, stop_token_ids=[stop_id]))
    for f, g in zip(free, out):
        cut = f.token_ids.index(stop_id) + 1 if stop_id in f.token_ids else 16
        assert g.token_ids == f.token_ids[:cut] and len(g.log_probs) == cut
        assert g.finish_reason == ("stop" if stop_id in f.token_ids else "length")
    # min_new_tokens / ignore_eos keep going past the stop token
    late = engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=16, stop_token_ids=[stop_id],
                                                       ignore_eos=True))[0]
    assert late.token_ids == free[0].token_ids and late.finish_reason == "length"
    # a stop string spanning two tokens ends the sample at the token that completes it
    text = tok.decode(free[1].token_ids)
    stop = text[7:9]
    first = text.index(stop) + len(stop)
    got = engine.generate(prompts[1:2], SamplingParams(temperature=0.0, max_new_tokens=16, stop=[stop]))[0]
    assert got.token_ids == free[1].token_ids[:first] and got.finish_reason == "stop"
    one = engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=1))[0]
    assert one.token_ids == free[0].token_ids[:1] and one.finish_reason == "length"


def test_errors_are_actionable():
    engine = _engine()
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.generate([[1] * 90], SamplingParams(max_new_tokens=10))
    with pytest.raises(ValueError, match="tokenizer"):
        engine.generate([[1]], SamplingParams(stop=["x"]))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="one seed per prompt"):
        engine.generate([[1], [2]], SamplingParams(max_new_tokens=4), seeds=[1])
    with pytest.raises(ValueError, match="SAMPLE_MODES|one of"):
        engine.runner.decode(2, 96, "nucleus")


def test_abort_returns_partial_and_waiting_samples():
    engine = _engine(num_slots=2)
    window = engine._decode_window

    def one_window_then_abort(*args):
        window(*args)
        engine.abort()

    engine._decode_window = one_window_then_abort
    out = engine.generate(_prompts(), SamplingParams(temperature=0.0, max_new_tokens=30))
    assert [g.finish_reason for g in out] == ["abort"] * len(LENGTHS)
    assert [len(g.token_ids) for g in out] == [5, 5] + [0] * (len(LENGTHS) - 2)  # prefill token + 4 decode steps
    assert all(len(g.log_probs) == len(g.token_ids) for g in out)


def test_on_finish_reports_each_sample_as_it_stops():
    """Stop tokens end samples at different steps through 3 slots (n = 2, so slots are freed and re-admitted):
    `on_finish` gets every sample once, equal to the returned one, before generate returns."""
    engine = _engine()
    prompts = _prompts()
    sampling = SamplingParams(temperature=1.0, max_new_tokens=20, n=2, stop_token_ids=list(range(0, 128, 9)), seed=3)
    reported = []
    out = engine.generate(prompts, sampling, on_finish=reported.append)
    stops = {g.finish_reason for g in out}
    assert stops == {"stop", "length"}  # both kinds of ending are exercised
    assert sorted(reported, key=lambda g: (g.prompt_index, g.sample_index)) == out
    first_done = [(g.prompt_index, g.sample_index) for g in reported]
    assert first_done != sorted(first_done)  # in the order they stopped, not the returned order
    assert engine.generate(prompts, sampling) == out  # the callback changes nothing
