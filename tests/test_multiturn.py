"""Multi-turn tool calling through the generation seam, on a scripted session engine (`fake_sessions.py`): the
seam's contract and its start-time errors, the Hermes parser, the tools, and every bad input (malformed call,
unknown tool, bad arguments, a tool that raises or hangs, budgets, max turns) ending as an observation or a
truncation with a reason, never a crash or a lost sample. The real engine: tests/test_multiturn_engine.py."""

from __future__ import annotations

import dataclasses
import json
import re
import time

import pytest
from fake_sessions import ScriptedSessions

from rlbench.configs import RolloutConfig
from rlbench.configs.multiturn import MultiTurnConfig
from rlbench.data import DataConfig, PromptDataset, build_tokenizer, make_arithmetic, write_jsonl
from rlbench.rollout.generate import load_generate_fn
from rlbench.rollout.manager import RolloutManager
from rlbench.rollout.multiturn import (
    TOOLS,
    MalformedToolCall,
    ToolCall,
    calculator,
    call_tools,
    format_call,
    observation_text,
    parse_tool_call,
    resolve_tools,
)
from rlbench.types import Sample, Status

MULTITURN = "rlbench.rollout.multiturn:generate"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _dataset(tmp_path, tok, n=16):
    path = str(tmp_path / "arith.jsonl")
    write_jsonl(make_arithmetic(n, seed=3), path)
    return PromptDataset(DataConfig(path=path), tok)


def _question(prompt_text: str) -> str:
    return prompt_text.split("user\n")[1].split("=?")[0]


def _last_response(context: str) -> str:
    return context.rsplit("<tool_response>\n", 1)[1].split("\n</tool_response>")[0]


def solver(prompt, j, turn, context):
    """Turn 0: call the calculator on the question; turn 1: box the tool's answer."""
    if turn == 0:
        return "let me compute " + format_call("calculator", {"expression": _question(prompt)})
    return f"\\boxed{{{_last_response(context)}}}<|im_end|>"


def _manager(tmp_path, tok, script, *, n=2, rbs=4, max_len=200, **mt):
    cfg = RolloutConfig(rollout_batch_size=rbs, n_samples_per_prompt=n, max_response_len=max_len, rm_type="math",
                        custom_generate_function_path=MULTITURN, multiturn=MultiTurnConfig(**mt))
    engine = ScriptedSessions(tok, script)
    return RolloutManager(cfg, engine, _dataset(tmp_path, tok), tok), engine


def _segments(sample: Sample, tok) -> list[tuple[int, str]]:
    """(mask, text) runs of the response."""
    out: list[tuple[int, list[int]]] = []
    for t, m in zip(sample.response_tokens, sample.loss_mask):
        if out and out[-1][0] == m:
            out[-1][1].append(t)
        else:
            out.append((m, [t]))
    return [(m, tok.decode(ids)) for m, ids in out]


# ---- the seam ----

def test_a_tool_call_round_trip_is_one_sample_with_the_observation_masked(tmp_path, tok):
    mgr, engine = _manager(tmp_path, tok, solver)
    batch = mgr.generate(0)
    assert len(batch.samples) == 8 and batch.metrics["rollout/raw_reward"] == 1.0
    s = batch.samples[0]
    call = "let me compute " + format_call("calculator", {"expression": _question(s.prompt)})
    answer = calculator(_question(s.prompt))
    obs = observation_text(answer)
    assert _segments(s, tok) == [(1, call), (0, obs), (1, f"\\boxed{{{answer}}}<|im_end|>")]
    obs_ids = tok(obs, add_special_tokens=False)["input_ids"]
    assert s.response_tokens[len(tok(call)["input_ids"]):][: len(obs_ids)] == obs_ids  # tokenized alone, as is
    assert s.rollout_log_probs[len(tok(call)["input_ids"]):][: len(obs_ids)] == [0.0] * len(obs_ids)
    assert s.response == call + f"\\boxed{{{answer}}}"  # what the model wrote, observation left out
    assert s.status == Status.COMPLETED and s.weight_version == 3
    assert s.metadata["turns"] == 2 and s.metadata["finish_reason"] == "stop"
    assert s.metadata["tool_calls"] == [{"turn": 1, "name": "calculator", "arguments": {
        "expression": _question(s.prompt)}, "error": None, "output": answer}]
    assert s.metadata["rm_type"] == "math"  # the row's metadata is kept
    assert engine.calls == [("generate", 8), ("continue", 8)] and not engine.open  # batched; every session released
    first, second = engine.seeds_seen
    assert [x + j + 1_000_003 for x in first for j in range(2)] == second  # turn t: the sample's seed + t * stride


def test_the_default_is_single_turn_and_a_custom_function_gets_the_round(tmp_path, tok, monkeypatch):
    import rlbench.rollout.generate as seam

    assert load_generate_fn(None) is seam.single_turn
    seen = []

    def custom(args, items, sampling, seeds):
        seen.append((len(items), sampling.n, list(seeds), args.cfg.n_samples_per_prompt))
        return [[Sample(tokens=it.prompt_token_ids + [5, 6], response_length=2, loss_mask=[1, 0],
                        rollout_log_probs=[-1.0, 0.0], response="\\boxed{0}") for _ in range(sampling.n)]
                for it in items]

    monkeypatch.setattr(seam, "my_generate", custom, raising=False)
    cfg = RolloutConfig(rollout_batch_size=3, n_samples_per_prompt=2,
                        custom_generate_function_path="rlbench.rollout.generate:my_generate")
    batch = RolloutManager(cfg, object(), _dataset(tmp_path, tok), tok).generate(0)
    assert len(seen) == 1 and seen[0][:2] == (3, 2) and len(seen[0][2]) == 3 and seen[0][3] == 2
    assert [s.loss_mask for s in batch.samples] == [[1, 0]] * 6 and [s.group_index for s in batch.samples] == [
        0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize("path, match", [
    ("no_such_module_xyz:generate", r"cannot import module 'no_such_module_xyz'"),
    ("rlbench.rollout.multiturn:generat", r"has no callable 'generat' \(did you mean 'generate'"),
    ("rlbench.rollout.multiturn:TOOLS", r"has no callable 'TOOLS'"),
    ("rlbench.rollout.generate:cut_at", r"must take \(args, items, sampling, seeds\)"),
    ("test_multiturn:async_generate", r"is an async function; define it with plain `def`"),
])
def test_a_bad_generate_path_fails_when_the_manager_is_built(tmp_path, tok, path, match):
    cfg = RolloutConfig(custom_generate_function_path=path)
    with pytest.raises(ValueError, match=match):
        RolloutManager(cfg, ScriptedSessions(tok, solver), _dataset(tmp_path, tok), tok)


async def async_generate(args, items, sampling, seeds):
    return []


def test_config_checks_the_path_syntax_and_the_tools():
    with pytest.raises(ValueError, match=r"custom_generate_function_path='multiturn' is not 'module.path:function'"):
        RolloutConfig(custom_generate_function_path="multiturn")
    with pytest.raises(ValueError, match=r"unknown tool 'calculater' \(multiturn.tools\) \(did you mean 'calculator'"):
        MultiTurnConfig(tools=("calculater",))
    with pytest.raises(ValueError, match="must be a list of tool names"):
        MultiTurnConfig(tools="calculator")
    with pytest.raises(ValueError, match="max_turns=0 must be >= 1"):
        MultiTurnConfig(max_turns=0)
    assert MultiTurnConfig(tools=["my_pkg.tools:search"]).tools == ("my_pkg.tools:search",)


def test_a_generate_function_returning_the_wrong_shape_is_named(tmp_path, tok, monkeypatch):
    import rlbench.rollout.generate as seam

    monkeypatch.setattr(seam, "short", lambda args, items, sampling, seeds: [[] for _ in items], raising=False)
    cfg = RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=2,
                        custom_generate_function_path="rlbench.rollout.generate:short")
    with pytest.raises(RuntimeError, match=r"returned 0 samples for prompt item 0; return one list of n=2 Samples"):
        RolloutManager(cfg, object(), _dataset(tmp_path, tok), tok).generate(0)


def test_an_engine_without_sessions_is_refused_by_name(tmp_path, tok):
    cfg = RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=2, custom_generate_function_path=MULTITURN)

    class NoSessions:
        supports_sessions = False
        weight_version = 0

    with pytest.raises(ValueError, match=r"needs an engine with sessions .* NoSessions has none: use "
                                         r"rollout_engine='torch'"):
        RolloutManager(cfg, NoSessions(), _dataset(tmp_path, tok), tok).generate(0)


def test_rounds_larger_than_the_free_slots_run_in_waves(tmp_path, tok):
    mgr, engine = _manager(tmp_path, tok, solver, n=2, rbs=5)
    engine.num_slots = 4  # two groups per wave
    batch = mgr.generate(0)
    assert [c for c in engine.calls if c[0] == "generate"] == [("generate", 4), ("generate", 4), ("generate", 2)]
    assert len(batch.samples) == 10 and batch.metrics["rollout/raw_reward"] == 1.0
    engine.num_slots = 1
    with pytest.raises(ValueError, match="a group of n=2 samples needs 2 free KV slots"):
        mgr.generate(1)


# ---- parser and tools ----

def test_the_parser_reads_hermes_calls_and_names_what_is_malformed():
    assert parse_tool_call("no call here<|im_end|>") is None
    assert parse_tool_call(format_call("calculator", {"expression": "1+2"})) == ToolCall("calculator", {"expression": "1+2"})
    assert parse_tool_call('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>') == ToolCall("f", {"x": 1})
    assert parse_tool_call('<tool_call>{"name": "f"}</tool_call>') == ToolCall("f", {})
    for text, why in [('{"name": "f"}</tool_call>', "without an opening <tool_call>"),
                      ("<tool_call>{name: f}</tool_call>", "not JSON"),
                      ("<tool_call>[1, 2]</tool_call>", "a JSON list, not an object"),
                      ('<tool_call>{"arguments": {}}</tool_call>', 'no "name" string'),
                      ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '"arguments" is a JSON list')]:
        with pytest.raises(MalformedToolCall, match=re.escape(why)):
            parse_tool_call(text)


def test_calculator_and_tool_errors_are_results():
    assert [calculator(e) for e in ("12*34", "(1+2)**3", "7/2", "9//2", "-4+1")] == ["408", "27", "3.5", "4", "-3"]
    with pytest.raises(ValueError, match="unsupported syntax"):
        calculator("__import__('os')")
    with pytest.raises(ValueError, match="exponent 1000 is larger than 64"):
        calculator("2**1000")
    tools = resolve_tools(("calculator",))

    def boom(x: int) -> str:
        raise ZeroDivisionError("nope")

    def hang(x: int) -> str:
        time.sleep(30)

    tools |= {"boom": dataclasses.replace(tools["calculator"], name="boom", fn=boom),
              "hang": dataclasses.replace(tools["calculator"], name="hang", fn=hang)}
    start = time.perf_counter()
    results = call_tools(tools, [("calculator", {"expression": "2+2"}), ("calculatr", {}), ("calculator", {"x": 1}),
                                 ("boom", {"x": 1}), ("hang", {"x": 1}), ("hang", {"x": 2})], timeout=0.3)
    assert time.perf_counter() - start < 3  # the two hangs share one deadline, and nobody waits for them after it
    assert [r.error for r in results] == [None, "unknown_tool", "bad_arguments", "raised", "timeout", "timeout"]
    assert results[0].output == "4"
    assert "unknown tool 'calculatr' (did you mean 'calculator'?); available tools: boom, calculator, hang" in results[1].output
    assert results[2].output.startswith("error: bad arguments for calculator:")
    assert results[3].output == "error: boom raised ZeroDivisionError: nope"
    assert results[4].output == "error: hang timed out after 0.3 s"


def test_tools_by_import_path_and_their_errors():
    assert resolve_tools(("rlbench.rollout.multiturn.tools:calculator",))["calculator"].fn is calculator
    with pytest.raises(ValueError, match="cannot import module 'nowhere_xyz'"):
        resolve_tools(("nowhere_xyz:f",))
    with pytest.raises(ValueError, match=r"has no callable 'calc' \(did you mean 'calculator'"):
        resolve_tools(("rlbench.rollout.multiturn.tools:calc",))


# ---- bad input inside a rollout: an observation or a truncation with a reason, never a crash ----

def _bad(prompt, j, turn, context):
    q = _question(prompt)
    if turn == 0:
        return ["<tool_call>{calculator: " + q + "}</tool_call>",                      # malformed
                format_call("abacus", {"expression": q}),                               # unknown tool
                format_call("calculator", {"expr": q}),                                 # bad arguments
                format_call("calculator", {"expression": q + "/0"}),                   # raises
                format_call("sleepy", {"seconds": 30}),                                 # hangs
                "\\boxed{1}<|im_end|>"][j]
    return "\\boxed{0}<|im_end|>"


def test_every_bad_call_becomes_an_observation_and_the_sample_goes_on(tmp_path, tok, monkeypatch):
    from rlbench.rollout.multiturn import Tool

    monkeypatch.setitem(TOOLS, "sleepy", Tool("sleepy", lambda seconds: time.sleep(seconds)))
    mgr, engine = _manager(tmp_path, tok, _bad, n=6, rbs=2, max_len=400, tools=("calculator", "sleepy"),
                           tool_timeout=0.3)
    start = time.perf_counter()
    batch = mgr.generate(0)
    assert time.perf_counter() - start < 5
    assert len(batch.samples) == 12 and not engine.open
    group = batch.samples[:6]
    errors = [s.metadata["tool_calls"][0]["error"] if s.metadata["tool_calls"] else None for s in group]
    assert errors == ["malformed", "unknown_tool", "bad_arguments", "raised", "timeout", None]
    outputs = [s.metadata["tool_calls"][0]["output"] for s in group[:5]]
    assert outputs[0].startswith("error: malformed tool call: the call is not JSON")
    assert outputs[1] == "error: unknown tool 'abacus'; available tools: calculator, sleepy"
    assert outputs[3] == "error: calculator raised ZeroDivisionError: division by zero"
    assert outputs[4] == "error: sleepy timed out after 0.3 s"
    for s, out in zip(group[:5], outputs):
        segs = _segments(s, tok)
        assert [m for m, _ in segs] == [1, 0, 1] and segs[1][1] == observation_text(out)
        assert s.status == Status.COMPLETED and s.metadata["turns"] == 2
    assert group[5].metadata["turns"] == 1 and group[5].loss_mask == [1] * group[5].response_length


def _chatty(prompt, j, turn, context):
    return format_call("calculator", {"expression": "1+1"})  # never answers


@pytest.mark.parametrize("mt, max_len, reason, turns", [
    ({"max_turns": 3}, 400, "max_turns", 3),                    # still calling after the last turn
    ({"max_turn_tokens": 20}, 400, "turn_budget", 1),          # a turn cut at 20 tokens
    ({}, 60, "total_budget", 1),                                # the first turn is longer than the whole budget
    ({}, 130, "total_budget", 1),                               # the observation does not fit after the call
    ({}, 200, "total_budget", 2),                               # the second turn overshoots: cut at the budget
])
def test_budgets_and_turn_limits_truncate_with_a_reason(tmp_path, tok, mt, max_len, reason, turns):
    mgr, engine = _manager(tmp_path, tok, _chatty, n=2, rbs=2, max_len=max_len, **mt)
    batch = mgr.generate(0)
    assert len(batch.samples) == 4 and not engine.open
    for s in batch.samples:
        assert s.status == Status.TRUNCATED and s.metadata["finish_reason"] == reason
        assert s.metadata["turns"] == turns and s.response_length <= max_len
        assert len(s.loss_mask) == len(s.rollout_log_probs) == s.response_length
    call_len = len(tok(_chatty("", 0, 0, ""))["input_ids"])
    s = batch.samples[0]
    if (mt, max_len) == ({}, 200):
        assert s.response_length == 200 and s.loss_mask[-1] == 1  # cut inside turn 2's tokens
    if (mt, max_len) == ({}, 130):
        assert s.response_length == call_len and s.metadata["tool_calls"][0]["error"] is None  # ran; not appended
    if mt == {"max_turns": 3}:
        assert len(s.metadata["tool_calls"]) == 2 and sum(1 for m, _ in _segments(s, tok) if m == 0) == 2
    assert batch.metrics["rollout/truncated_ratio"] == 1.0


def test_mask_truncated_zeroes_a_truncated_multi_turn_sample(tmp_path, tok):
    mgr, _ = _manager(tmp_path, tok, _chatty, n=2, rbs=2, max_len=400, max_turns=2)
    mgr.cfg = dataclasses.replace(mgr.cfg, mask_truncated=True)
    batch = mgr.generate(0)
    assert all(s.loss_mask == [0] * s.response_length for s in batch.samples)


def test_eval_runs_the_multi_turn_function_too(tmp_path, tok):
    from rlbench.configs import EvalConfig

    mgr, engine = _manager(tmp_path, tok, solver)
    items = _dataset(tmp_path, tok).items[:6]
    out = mgr.evaluate(items, EvalConfig(n_samples_per_prompt=2, pass_k=(1, 2)))
    assert out["eval/reward"] == 1.0 and out["eval/pass@2"] == 1.0 and ("continue", 12) in engine.calls
    assert json.loads(json.dumps(out)) == out
