"""Sessions on the torch engine (CPU, tiny Qwen3): a kept sample continues from its KV cache.

A continuation prefills only the new tokens (counted by the runner) and samples exactly as a fresh engine given
the whole context as its prompt: log-probs allclose in fp32, bitwise with batch-invariant numerics. Token ids,
log-probs and the loss mask accumulate per session; budgets end a turn with "length"; kept slots count against
`num_slots`.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from fake_sglang import EMBED, NORM, FakeSGLang
from safetensors.torch import save_file

from rlbench import numerics
from rlbench.algorithms import token_logprobs
from rlbench.configs import SGLangEngineConfig
from rlbench.engine import SamplingParams, TorchEngine, TorchEngineConfig
from rlbench.engine.protocol import SessionEngine, supports_sessions
from rlbench.engine.sglang_engine import SGLangEngine
from rlbench.models import build_model

pytestmark = pytest.mark.usefixtures("one_thread")

T = 0.7
PROMPTS = [[5, 17, 3, 99, 42], [8, 8, 120, 7, 1, 64, 33, 2, 9], [77]]


def _model():
    """The tiny Qwen3 with its matrices x4: logits far from uniform, so rounding differences show in log-probs."""
    model = build_model("tiny", seed=0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4)
    return model


def _engine(num_slots=8, max_seq_len=128, **kw):
    cfg = TorchEngineConfig(max_seq_len=max_seq_len, num_slots=num_slots, steps_per_sync=4, **kw)
    return TorchEngine(_model(), cfg)


def _sampling(max_new=12, **kw):
    return SamplingParams(temperature=T, max_new_tokens=max_new, **kw)


def _obs(i: int, n: int = 4) -> list[int]:
    return [(31 * i + 7 * j + 11) % 128 for j in range(n)]


def _assert_same(got, want, bitwise: bool):
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
    a, b = torch.tensor(got.log_probs), torch.tensor(want.log_probs)
    if bitwise:
        assert torch.equal(a, b), f"max |diff| {(a - b).abs().max():.3e}"
    else:
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("n", [1, 3], ids=["n1", "n3-grouped"])
@pytest.mark.parametrize("mode", ["fp32", "batch-invariant", "hf-layers"])
def test_continuation_prefills_only_new_tokens_and_equals_a_fresh_prefill(mode, n):
    """Turn 2 of each kept sample (n = 3: decoded in the grouped layout, then moved to its own slot) == a fresh
    engine given prompt + turn 1 + observation as its prompt with the same seed; the continuation prefilled
    exactly the observations plus each sample's last sampled token."""
    kw = {"batch_invariant": mode == "batch-invariant", "fused_weights": mode != "hf-layers"}
    engine = _engine(num_slots=9, **kw)
    first = engine.generate(PROMPTS, _sampling(n=n, stop_token_ids=[3, 9]), seeds=[10, 20, 30], keep=True)
    assert (engine._group > 1) == (n > 1)  # n = 3 did run in the grouped layout
    assert engine.free_slots == 9 - 3 * n and all(g.session.open for g in first)
    observations = [_obs(i, 2 + i % 3) for i in range(len(first))]
    before = engine.runner.prefilled_tokens
    second = engine.continue_([g.session for g in first], observations, _sampling(), seeds=range(50, 50 + len(first)))
    assert engine.runner.prefilled_tokens - before == sum(len(o) + 1 for o in observations)

    fresh = _engine(**kw)
    for i, (g1, g2, obs) in enumerate(zip(first, second, observations)):
        context = PROMPTS[g1.prompt_index] + g1.token_ids + obs
        ref = fresh.generate([context], _sampling(), seeds=[50 + i])[0]
        _assert_same(g2, ref, bitwise=mode == "batch-invariant")
        assert g2.session is g1.session and g2.session.token_ids == context + g2.token_ids
    other = fresh.generate([PROMPTS[0] + first[0].token_ids + [1, 2]], _sampling(), seeds=[50])[0]
    assert other.log_probs[0] != second[0].log_probs[0]  # the comparison can fail: another context, other numbers


def _trainer_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """The trainer's recompute of one sequence: log p(token t | tokens < t) at T, for t = 1..len - 1."""
    ids = torch.tensor(tokens)
    with torch.no_grad():
        logits = model(input_ids=ids[None], position_ids=torch.arange(len(tokens))[None], use_cache=False).logits[0]
    logp, _ = token_logprobs(logits, torch.roll(ids, -1), T, with_entropy=False, lse_fn=numerics.logsumexp_rows)
    return logp[:-1]


def test_three_turn_session_records_ids_log_probs_and_loss_mask_and_stays_on_policy():
    """3 turns (stop tokens end turns at different lengths): the session's ids are the prompt, the engine's outputs
    and the observations, concatenated; the mask is 0 exactly on the observations; the rollout log-probs of the
    sampled tokens equal the batch-invariant trainer's recompute of the whole sequence bit for bit."""
    engine = _engine(batch_invariant=True)
    trainer = numerics.make_batch_invariant(copy.deepcopy(_model())).eval()
    sampling = _sampling(max_new=10, stop_token_ids=[3, 9, 40])
    turns = [engine.generate(PROMPTS[:2], sampling, seeds=[1, 2], keep=True)]
    sessions = [g.session for g in turns[0]]
    obs = [[[60, 61, 62], [70]], [[80, 81], [90, 91, 92, 93, 94]]]
    for k in range(2):
        turns.append(engine.continue_(sessions, obs[k], sampling, seeds=[100 * k + 5, 100 * k + 6]))
    assert {len(g.token_ids) for t in turns for g in t} != {10}  # some turns stopped early
    for i, session in enumerate(sessions):
        out = [turns[k][i].token_ids for k in range(3)]
        assert session.token_ids == PROMPTS[i] + out[0] + obs[0][i] + out[1] + obs[1][i] + out[2]
        assert session.loss_mask == ([1] * len(out[0]) + [0] * len(obs[0][i]) + [1] * len(out[1])
                                     + [0] * len(obs[1][i]) + [1] * len(out[2]))
        assert session.log_probs == (turns[0][i].log_probs + [0.0] * len(obs[0][i]) + turns[1][i].log_probs
                                     + [0.0] * len(obs[1][i]) + turns[2][i].log_probs)
        assert session.turns == 3 and session.open
        recomputed = _trainer_logprobs(trainer, session.token_ids)[len(PROMPTS[i]) - 1:]
        mask = torch.tensor(session.loss_mask, dtype=torch.bool)
        assert torch.equal(torch.tensor(session.log_probs)[mask], recomputed[mask])  # |diff| == 0.0
        assert not torch.equal(torch.tensor(session.log_probs)[~mask], recomputed[~mask])  # observations differ


def test_sessions_continue_in_one_batch_with_fresh_prompts():
    """4 slots: 2 sessions continue (released as their turns end) while 4 fresh prompts wait for slots; a grouped
    n = 2 generate between the turns runs in the slot layout and leaves the kept slots intact. Every sample equals
    its reference alone."""
    engine, ref = _engine(num_slots=4), _engine(num_slots=4)
    first = engine.generate(PROMPTS[:2], _sampling(), seeds=[1, 2], keep=True)
    between = engine.generate(PROMPTS[1:], _sampling(n=2), seeds=[7, 8])
    assert engine._group == 1 and engine.free_slots == 2
    for g, want in zip(between, ref.generate(PROMPTS[1:], _sampling(n=2), seeds=[7, 8])):
        _assert_same(g, want, bitwise=False)
    fresh = [PROMPTS[2], [4, 4, 4], PROMPTS[0], [9, 100, 3]]
    out = engine.continue_([g.session for g in first], [_obs(0), _obs(1)], _sampling(max_new=20), seeds=[3, 4],
                           keep=False, prompts=fresh, prompt_seeds=[11, 12, 13, 14])
    assert [g.prompt_index for g in out] == list(range(6)) and engine.free_slots == 4
    assert all(not g.session.open for g in out[:2]) and all(g.session is None for g in out[2:])
    for i in range(2):
        context = PROMPTS[i] + first[i].token_ids + _obs(i)
        _assert_same(out[i], ref.generate([context], _sampling(max_new=20), seeds=[3 + i])[0], bitwise=False)
    for g, want in zip(out[2:], ref.generate(fresh, _sampling(max_new=20), seeds=[11, 12, 13, 14])):
        _assert_same(g, want, bitwise=False)


def test_a_turn_past_max_seq_len_finishes_with_length_and_keeps_its_tokens():
    """max_seq_len 48: a turn samples until the context is full ("length"); an observation that does not fit is
    cut to what fits, nothing is prefilled and the turn ends at once ("length", no tokens); never a crash."""
    engine = _engine(max_seq_len=48)
    prompt = list(range(1, 31))  # 30 tokens + 10 sampled = 40
    session = engine.generate([prompt], _sampling(max_new=10, ignore_eos=True), seeds=[1], keep=True)[0].session
    out = engine.continue_([session], [[5] * 5], _sampling(max_new=10, ignore_eos=True), seeds=[2])[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3 and len(session.token_ids) == 48
    before = engine.runner.prefilled_tokens
    full = engine.continue_([session], [[6, 7]], _sampling(max_new=10), seeds=[3])[0]
    assert (full.finish_reason, full.token_ids, engine.runner.prefilled_tokens) == ("length", [], before)
    assert len(session.token_ids) == 48 and session.turns == 3 and session.open

    short = engine.generate([prompt[:20]], _sampling(max_new=10, ignore_eos=True), seeds=[1], keep=True)[0].session
    cut = engine.continue_([short], [list(range(40, 60))], _sampling(), seeds=[2])[0]  # 30 + 20 > 48: 18 fit
    assert (cut.finish_reason, cut.token_ids) == ("length", [])
    assert short.response_ids[10:] == list(range(40, 58)) and short.loss_mask[10:] == [0] * 18


def test_kept_slots_count_against_num_slots_and_release_frees_them():
    engine = _engine(num_slots=4)
    kept = engine.generate(PROMPTS[:2], _sampling(n=2), seeds=[1, 2], keep=True)
    assert engine.free_slots == 0 and len(engine.sessions) == 4
    with pytest.raises(RuntimeError, match=r"0 of num_slots=4 are free \(4 held by open sessions\): release\(\).*"
                                           r"raise TorchEngineConfig.num_slots"):
        engine.generate([PROMPTS[2]], _sampling())
    with pytest.raises(RuntimeError, match="1 prompts x n=1, every sample kept need 1 KV slots"):
        engine.continue_([kept[0].session], [[1]], _sampling(), prompts=[PROMPTS[2]], prompt_seeds=[0])
    engine.release([kept[0].session, kept[1].session])
    engine.release([kept[0].session])  # closed sessions are skipped
    assert engine.free_slots == 2 and not kept[0].session.open and kept[2].session.open
    with pytest.raises(ValueError, match=r"sessions\[0\] \(id 0\) was closed"):
        engine.continue_([kept[0].session], [[1]], _sampling())
    with pytest.raises(ValueError, match="appears twice"):
        engine.continue_([kept[2].session, kept[2].session], [[1], [2]], _sampling())
    assert engine.generate([PROMPTS[2]], _sampling(), seeds=[5])[0].session is None
    with pytest.raises(RuntimeError, match=r"sleep\(\) would free the KV cache under 2 open sessions"):
        engine.sleep()
    engine.flush_cache()
    assert engine.free_slots == 4 and not kept[3].session.open
    engine.sleep()
    engine.wake_up()


def test_an_aborted_turn_records_its_tokens_and_closes_its_session():
    """abort() from on_finish: the session whose turn ended stays open, the one still decoding comes back "abort",
    its partial turn recorded and its session closed; a fresh prompt of the call comes back "abort", not kept."""
    engine = _engine(num_slots=3, max_seq_len=48)
    near_full = engine.generate([list(range(1, 41))], _sampling(max_new=5, ignore_eos=True), seeds=[1], keep=True)
    roomy = engine.generate([PROMPTS[0]], _sampling(max_new=5, ignore_eos=True), seeds=[2], keep=True)
    sessions = [near_full[0].session, roomy[0].session]  # 45 tokens: 2 more fit; 10: 20 more fit
    out = engine.continue_(sessions, [[1], [2]], _sampling(max_new=20, ignore_eos=True), seeds=[3, 4],
                           on_finish=lambda g: engine.abort(), prompts=[PROMPTS[2]], prompt_seeds=[5])
    assert [g.finish_reason for g in out] == ["length", "abort", "abort"]
    assert len(out[0].token_ids) == 2 and 0 < len(out[1].token_ids) < 20 and out[2].session is None
    assert sessions[0].open and not sessions[1].open and engine.free_slots == 2
    assert sessions[1].response_ids == roomy[0].token_ids + [2] + out[1].token_ids and sessions[1].turns == 2


def test_sessions_are_a_capability_the_sglang_adapter_refuses_by_name(tmp_path):
    save_file({EMBED: torch.zeros(4, 2, dtype=torch.bfloat16), NORM: torch.ones(2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": True, "torch_dtype": "bfloat16"}))
    sglang = SGLangEngine(SGLangEngineConfig(model_path=str(tmp_path)), engine=FakeSGLang(deterministic=True))
    engine = _engine(num_slots=2)
    assert supports_sessions(engine) and isinstance(engine, SessionEngine)
    assert not supports_sessions(sglang) and not supports_sessions(object())
    for call in (lambda: sglang.generate([[1]], SamplingParams(), keep=True),
                 lambda: sglang.continue_([], [], SamplingParams()), lambda: sglang.release([])):
        with pytest.raises(NotImplementedError, match="SGLangEngine has no sessions"):
            call()
    assert sglang.generate([[1]], SamplingParams(max_new_tokens=2, seed=0))[0].session is None
