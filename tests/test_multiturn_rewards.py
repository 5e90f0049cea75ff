"""Multi-turn samples are scored as they finish (`args.on_sample` inside a wave), as single-turn ones are: a sample
that answers at once is in the reward pool while the others of its wave still wait for their tools; the batch and
its rewards are those of scoring after generation; a reward that raises or hangs fails the round naming the sample,
as in single-turn. On the scripted session engine (`fake_sessions.py`)."""

from __future__ import annotations

import hashlib
import time
import zlib

import pytest
from fake_sessions import ScriptedSessions
from test_multiturn import _dataset, _last_response, _question
from test_trainer_rollout import ScriptedEngine

from rlbench.configs import RolloutConfig
from rlbench.configs.multiturn import MultiTurnConfig
from rlbench.data import build_tokenizer
from rlbench.rewards import RewardError
from rlbench.rollout.manager import RolloutManager
from rlbench.rollout.multiturn import TOOLS, Tool, calculator, format_call

MULTITURN = "rlbench.rollout.multiturn:generate"
WAIT_LIMIT = 120.0
"""Seconds the slow tool waits for the early rewards before giving up (the test then fails on the event order)."""


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _manager(tmp_path, tok, script, *, workers: int, rm_type="math", n=4, rbs=2, slots=64, timeout=30.0, max_len=200,
             **mt):
    cfg = RolloutConfig(rollout_batch_size=rbs, n_samples_per_prompt=n, max_response_len=max_len, rm_type=rm_type,
                        reward_timeout=timeout, custom_generate_function_path=MULTITURN,
                        multiturn=MultiTurnConfig(**mt))
    engine = ScriptedSessions(tok, script, num_slots=slots)
    return RolloutManager(cfg, engine, _data(tmp_path, tok), tok, reward_workers=workers), engine


def _data(tmp_path, tok):
    """The arithmetic prompts without their per-row `rm_type` ("math"), so `RolloutConfig.rm_type` decides."""
    dataset = _dataset(tmp_path, tok)
    for item in dataset.items:
        item.metadata.pop("rm_type", None)
    return dataset


def _events(path) -> list[str]:
    with open(path) as f:
        return f.read().splitlines()


def _answer_or_wait(prompt, j, turn, context):
    """Even samples answer at once; odd ones first call `wait`, which returns once the even ones were scored."""
    q = _question(prompt)
    if j % 2 == 0:
        return f"\\boxed{{{calculator(q)}}}<|im_end|>"
    if turn == 0:
        return format_call("wait", {"expression": q})
    return f"\\boxed{{{_last_response(context)}}}<|im_end|>"


def test_a_sample_that_answers_is_scored_while_its_wave_still_runs_tools(tmp_path, tok, monkeypatch):
    events = str(tmp_path / "events")
    monkeypatch.setenv("RLBENCH_TEST_EVENTS", events)
    rbs, n = 2, 4
    early = rbs * n // 2

    def wait(expression: str) -> str:  # holds its turn until the early samples' rewards are logged (or the limit)
        deadline = time.monotonic() + WAIT_LIMIT
        while sum(line.startswith("reward") for line in _events(events)) < early and time.monotonic() < deadline:
            time.sleep(0.01)
        with open(events, "a") as f:
            f.write("tool done\n")
        return calculator(expression)

    monkeypatch.setitem(TOOLS, "wait", Tool("wait", wait))
    open(events, "w").close()
    mgr, engine = _manager(tmp_path, tok, _answer_or_wait, workers=2, rm_type="reward_helpers:logged", n=n, rbs=rbs,
                           tools=("wait",), tool_timeout=WAIT_LIMIT + 60)
    batch = mgr.generate(0)
    mgr.reward_pool.close()
    log = _events(events)
    assert engine.calls == [("generate", 8), ("continue", 4)]  # one wave: the answers and the calls side by side
    direct = [i for i, line in enumerate(log) if line.startswith("reward") and "tool_call" not in line]
    tooled = [i for i, line in enumerate(log) if line.startswith("reward") and "tool_call" in line]
    done = [i for i, line in enumerate(log) if line == "tool done"]
    assert len(direct) == len(tooled) == early and len(done) == early  # each sample scored once
    assert max(direct) < min(done), log  # the answers were scored before any tool of their wave returned
    assert max(done) < min(tooled), log
    assert batch.metrics["rollout/raw_reward"] == 1.0


KINDS = ("answer", "wrong", "calculator", "malformed", "unknown", "raises", "chatty", "long")


def _mixed(prompt, j, turn, context):
    """A fixed mix of endings per (prompt, sample): answers right or wrong, tool calls good and bad, a sample that
    keeps calling (max_turns), one whose turn overruns the per-turn budget."""
    q = _question(prompt)
    kind = KINDS[(zlib.crc32(prompt.encode()) + j) % len(KINDS)]
    if kind == "chatty":
        return format_call("calculator", {"expression": "1+1"})
    if turn > 0:
        return f"\\boxed{{{_last_response(context) if kind == 'calculator' else 0}}}<|im_end|>"
    return {"answer": f"\\boxed{{{calculator(q)}}}<|im_end|>", "wrong": "\\boxed{-1}<|im_end|>",
            "calculator": format_call("calculator", {"expression": q}), "malformed": "<tool_call>{x}</tool_call>",
            "unknown": format_call("abacus", {"expression": q}),
            "raises": format_call("calculator", {"expression": q + "/0"}),
            "long": "x" * 120}[kind]


def _digest(samples) -> str:
    """sha256 of every field the trainer reads, floats by repr (bit-exact)."""
    rows = [(s.tokens, s.response_length, s.loss_mask, [repr(x) for x in s.rollout_log_probs], repr(s.reward),
             s.status.name, s.response, s.group_index, s.index, s.weight_version, sorted(s.metadata.items()))
            for s in samples]
    return hashlib.sha256(repr(rows).encode()).hexdigest()


PINNED = "b154f750c14d7e61c33925bbf80ed917accf30e6dec68c6fcc1a29b48b4359c5"
"""`_digest` of the batch below, recorded with the loop that scored each wave only after all its turns."""


def test_early_scoring_keeps_the_batch_and_rewards_bit_for_bit(tmp_path, tok):
    batches = {}
    for workers in (0, 2):  # 0: scored inline after generation; 2: each sample in the pool as it finishes
        mgr, engine = _manager(tmp_path, tok, _mixed, workers=workers, n=4, rbs=5, slots=8, max_len=400,
                               max_turns=3, max_turn_tokens=100)
        batches[workers] = mgr.generate(0)
        if mgr.reward_pool is not None:
            mgr.reward_pool.close()
        assert [c for c in engine.calls if c[0] == "generate"] == [("generate", 8)] * 2 + [("generate", 4)]
    inline, pooled = batches[0].samples, batches[2].samples
    assert _digest(inline) == _digest(pooled)
    reasons = {s.metadata["finish_reason"] for s in pooled}
    assert reasons == {"stop", "max_turns", "turn_budget"}, reasons  # every way a trajectory ends, in one round
    assert 0 < sum(s.reward for s in pooled) < len(pooled)
    assert _digest(pooled) == PINNED


def test_a_reward_that_raises_in_a_wave_names_the_sample_as_in_single_turn(tmp_path, tok):
    mgr, engine = _manager(tmp_path, tok, _answer_or_wait_calc, workers=2, rm_type="reward_helpers:boom",
                           tools=("calculator",))
    with pytest.raises(RewardError, match=r"reward 'reward_helpers:boom' raised on sample 0 \(prompt=.*"
                                          r"ZeroDivisionError: the reward's own bug"):
        mgr.generate(0)
    assert not engine.open  # every session released
    mgr.reward_pool.close()
    single = RolloutManager(RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=4, rm_type="reward_helpers:boom"),
                            ScriptedEngine(tok), _data(tmp_path, tok), tok, reward_workers=2)
    with pytest.raises(RewardError, match=r"reward 'reward_helpers:boom' raised on sample 0 \(prompt="):
        single.generate(0)
    single.reward_pool.close()


def _answer_or_wait_calc(prompt, j, turn, context):
    return _answer_or_wait(prompt, j, turn, context).replace('"wait"', '"calculator"')


def test_a_reward_that_hangs_in_a_wave_times_out_naming_the_sample(tmp_path, tok):
    mgr, engine = _manager(tmp_path, tok, _answer_or_wait_calc, workers=2, rm_type="reward_helpers:hang",
                           timeout=0.5, tools=("calculator",))
    with pytest.raises(RewardError, match=r"reward 'reward_helpers:hang' timed out after 0.5s on sample 0 \(prompt="
                                          r".*raise rollout.reward_timeout"):
        mgr.generate(0)
    assert not engine.open
    mgr.reward_pool.close()
