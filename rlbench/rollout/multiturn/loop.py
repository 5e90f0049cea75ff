"""Multi-turn tool calling on engine sessions: `rlbench.rollout.multiturn:generate` (a `GenerateFn`).

Per round (all samples of all prompts batched in each engine call):
  1. `engine.generate(prompts, keep=True)`: turn 1 of every sample; a turn stops at `</tool_call>` or EOS.
  2. Each kept sample whose turn wrote a tool call gets the call run (`tools.call_tools`, concurrently, with
     `multiturn.tool_timeout`); the observation text (`syntax.observation_text`) alone is tokenized and appended
     with `engine.continue_` (loss mask 0), which samples the next turn from the cached prefix.
  3. Repeat until no sample calls a tool or `multiturn.max_turns` turns ran; the sessions are released.

A `Sample` is the session's record, never re-tokenized: `tokens` = prompt + every sampled and appended id,
`loss_mask` 1 on sampled ids and 0 on observations, `rollout_log_probs` the sampling log-probs (0.0 on
observations). `response` is the text the model wrote (observations left out), so a reward never credits tool
output. `metadata` gains `turns`, `tool_calls` (turn, name, arguments, error kind, output) and `finish_reason`:
"stop" (a final answer), or why the sample was truncated: "turn_budget" (a turn hit `multiturn.max_turn_tokens`),
"total_budget" (the response reached `max_response_len`: cut there, or an observation did not fit), "max_seq_len"
(the engine's context is full), "max_turns" (still calling a tool after the last turn), or "abort".

A malformed call, an unknown tool, bad arguments, a tool that raises or hangs: each is an observation naming the
problem, and the model goes on. Samples of a round run in waves that fit the engine's free KV slots.

A sample is final the moment its trajectory ends (a final answer, a budget, the last turn): it becomes its `Sample`
then, and goes to `args.on_sample` at once, so the manager scores it while the rest of its wave still runs turns
and tools. The returned groups hold those same objects, in item order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rlbench.engine.protocol import Generation, SamplingParams, Session, supports_sessions
from rlbench.rollout.generate import GenerateArgs
from rlbench.rollout.multiturn.syntax import (
    CALL_END,
    MalformedToolCall,
    ToolCall,
    observation_text,
    parse_tool_call,
)
from rlbench.rollout.multiturn.tools import Tool, ToolResult, call_tools, resolve_tools
from rlbench.types import Sample, Status

TURN_SEED_STRIDE = 1_000_003
"""Turn t (t >= 1 counts the continuations) of a sample seeded s samples with seed `s + t * TURN_SEED_STRIDE`."""


@dataclass
class Trajectory:
    """One sample's progress over its turns."""

    item: object
    seed: int
    index: int
    """The sample's place in the round, `i * n + j` (what `args.on_sample` gets)."""
    session: Session | None = None
    weight_version: int = 0
    tool_calls: list[dict] = field(default_factory=list)
    finish: str | None = None
    """None while the sample goes on; then "stop" or a truncation reason (see the module docstring)."""
    length: int | None = None
    """Response tokens kept (None: all of the session's); set when a turn overshot the total budget."""


def generate(args: GenerateArgs, items: Sequence, sampling: SamplingParams, seeds: Sequence[int]) -> list[list[Sample]]:
    """Tool-calling samples for a round of prompt items (see the module docstring); `sampling.max_new_tokens` is the
    whole response's budget, `args.cfg.multiturn` the tools, turns and per-turn budget."""
    engine, n = args.engine, sampling.n
    if not supports_sessions(engine):
        raise ValueError(f"rlbench.rollout.multiturn:generate continues samples across turns and needs an engine with "
                         f"sessions (rlbench.engine.protocol.SessionEngine); {type(engine).__name__} has none: use "
                         "rollout_engine='torch', or single-turn generation (custom_generate_function_path=None)")
    tools = resolve_tools(args.cfg.multiturn.tools)
    wave = engine.free_slots // n
    if wave < 1:
        raise ValueError(f"a group of n={n} samples needs {n} free KV slots for its sessions, the engine has "
                         f"{engine.free_slots}; raise engine.num_slots")
    flat: list[Sample | None] = [None] * (len(items) * n)

    def done(traj: Trajectory) -> None:  # the trajectory ended: its Sample now, scored while the wave goes on
        flat[traj.index] = to_sample(traj, args.tokenizer)
        if args.on_sample is not None:
            args.on_sample(traj.index, flat[traj.index])

    for start in range(0, len(items), wave):
        part = list(range(start, min(start + wave, len(items))))
        trajs = [Trajectory(items[i], int(seeds[i]) + j, i * n + j) for i in part for j in range(n)]
        _run_wave(args, tools, trajs, [items[i].prompt_token_ids for i in part], [seeds[i] for i in part], sampling,
                  done)
    assert all(s is not None for s in flat), "every trajectory of every wave ends with a finish"
    return [flat[i * n : (i + 1) * n] for i in range(len(items))]


def _run_wave(args: GenerateArgs, tools: dict[str, Tool], trajs: list[Trajectory], prompts: list, seeds: list,
              sampling: SamplingParams, done: Callable[[Trajectory], None]) -> None:
    """Every turn of `trajs` (the samples of `prompts`, n each); leaves each with a `finish` and no open session.
    `done(traj)` is called once per trajectory, when it ends (its session is complete then, though still open)."""
    engine, mt, tokenizer = args.engine, args.cfg.multiturn, args.tokenizer
    total = sampling.max_new_tokens
    per_turn = min(mt.max_turn_tokens or total, total)
    turn = dataclasses.replace(sampling, max_new_tokens=per_turn, stop=[*sampling.stop, CALL_END])
    gens = engine.generate(prompts, turn, seeds=seeds, keep=True)
    live = list(zip(trajs, gens))
    try:
        for t in range(1, mt.max_turns + 1):
            calls = []
            for traj, gen in live:
                call = _after_turn(traj, gen, sampling, per_turn, total, tokenizer, last=t == mt.max_turns)
                if call is None:
                    done(traj)
                else:
                    calls.append((traj, call))
            if not calls:
                break
            pending, observations = [], []
            for traj, call, result in zip(*zip(*calls), _results(tools, [c for _, c in calls], mt.tool_timeout)):
                traj.tool_calls.append({"turn": t, "name": getattr(call, "name", None),
                                        "arguments": getattr(call, "arguments", None), "error": result.error,
                                        "output": result.output})
                obs = tokenizer(observation_text(result.output, mt.max_observation_chars),
                                add_special_tokens=False)["input_ids"]
                if len(traj.session.response_ids) + len(obs) >= total:  # no room to sample after it
                    traj.finish = "total_budget"
                    done(traj)
                else:
                    pending.append(traj)
                    observations.append(obs)
            if not pending:
                break
            room = max(total - len(traj.session.response_ids) - len(obs) for traj, obs in zip(pending, observations))
            nxt = dataclasses.replace(turn, n=1, max_new_tokens=min(per_turn, room))
            gens = engine.continue_([traj.session for traj in pending], observations, nxt,
                                    seeds=[traj.seed + t * TURN_SEED_STRIDE for traj in pending])
            live = list(zip(pending, gens))
    finally:
        engine.release([traj.session for traj in trajs if traj.session is not None])


def _after_turn(traj: Trajectory, gen: Generation, sampling: SamplingParams, per_turn: int, total: int, tokenizer,
                last: bool):
    """Settle a finished turn: set `traj.finish` (and return None), or return the turn's tool call (a `ToolCall`, or
    the `MalformedToolCall` explaining why it is not one)."""
    if gen.session is None:  # a first turn aborted before it finished is not kept: record it alone
        gen.session = Session(-1, list(traj.item.prompt_token_ids), open=False)
        gen.session.append(gen.token_ids, gen.log_probs)
        gen.session.turns = 1
    traj.session, traj.weight_version = gen.session, gen.weight_version
    response = len(traj.session.response_ids)
    if gen.finish_reason == "abort":
        traj.finish = "abort"
    elif response > total or (response == total and gen.finish_reason == "length"):
        traj.finish, traj.length = "total_budget", total
    elif gen.finish_reason == "length":
        traj.finish = "turn_budget" if len(gen.token_ids) >= per_turn else "max_seq_len"
    elif gen.token_ids and gen.token_ids[-1] in sampling.stop_token_ids:
        traj.finish = "stop"
    else:
        try:
            call = parse_tool_call(tokenizer.decode(gen.token_ids))
        except MalformedToolCall as exc:
            call = exc
        if call is None:
            traj.finish = "stop"  # another stop string of the caller's
        elif last:
            traj.finish = "max_turns"
        else:
            return call
    return None


def _results(tools: dict[str, Tool], calls: list, timeout: float) -> list[ToolResult]:
    """One result per call: the tool's (run concurrently), or for a malformed call its parse error."""
    valid = [c for c in calls if isinstance(c, ToolCall)]
    ran = iter(call_tools(tools, [(c.name, c.arguments) for c in valid], timeout))
    return [next(ran) if isinstance(c, ToolCall) else ToolResult(f"error: malformed tool call: {c}", "malformed")
            for c in calls]


def to_sample(traj: Trajectory, tokenizer) -> Sample:
    """The trajectory's session as a Sample (cut to `traj.length` when the last turn overshot the budget)."""
    s = traj.session
    length = len(s.response_ids) if traj.length is None else traj.length
    mask = list(s.loss_mask[:length])
    model_ids = [t for t, m in zip(s.response_ids[:length], mask) if m]
    status = {"stop": Status.COMPLETED, "abort": Status.ABORTED}.get(traj.finish, Status.TRUNCATED)
    item = traj.item
    return Sample(
        tokens=list(s.prompt_ids) + list(s.response_ids[:length]),
        response_length=length,
        loss_mask=mask,
        rollout_log_probs=[float(x) for x in s.log_probs[:length]],
        weight_version=traj.weight_version,
        status=status,
        prompt=item.prompt,
        label=item.label,
        response=tokenizer.decode(model_ids, skip_special_tokens=True),
        metadata=dict(item.metadata) | {"turns": s.turns, "tool_calls": traj.tool_calls, "finish_reason": traj.finish},
    )
