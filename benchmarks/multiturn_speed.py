"""Multi-turn rollout speed beside single-turn: generated tokens/s of the torch engine's sessions on one engine.

    python benchmarks/multiturn_speed.py --device cuda --out $OUT/multiturn_speed.json   # qwen3-0.6b-shape, bf16
    python benchmarks/multiturn_speed.py --device cpu --threads 1                         # tiny, fp32, ~15 s

The workload: a randomly initialised model of a preset shape (`rlbench.models.build_model`; qwen3-0.6b-shape in
bf16 on CUDA, tiny in fp32 on CPU), `--batch` B samples = B / n prompts x n (`--n`, the GRPO group) of
`--prompt-len` P random token ids (defaults per device: `DEFAULTS`; CUDA: 8 prompts x 8, P = 512, K = 4 turns of
T = 128, O = 64), temperature 1, EOS ignored so both variants do the same generated work:

- multi-turn: `--turns` K turns of exactly `--turn-tokens` T tokens: `generate(keep=True)` for the first, then
  `continue_` appending an observation of `--obs-tokens` O fixed token ids (standing for a tool result) to every
  session before each next turn (the last turn with `keep=False`, which closes the sessions), as
  `rlbench.rollout.multiturn` drives the engine without the tool calls and tokenization;
- single-turn: one `generate` of K*T tokens per sample.

Both run on one `TorchEngine` built as the trainer builds it (`rlbench.orchestration.local.engine_config`: the
`TorchEngineConfig` defaults, so compile, CUDA graphs, decode attention "auto" and the shared-prefix layout on
CUDA; slots sized from memory on CUDA but at most B, B on CPU). Each variant runs once untimed first (compile
and graph capture: `first_s`), then `--repeats` timed runs (median; `torch.cuda.synchronize` around each engine
call on CUDA). Reported: generated tokens/s of both and their ratio (multi / single), the wall of each turn,
and the prefill tokens the engine ran (`ModelRunner.prefilled_tokens`). The prompt is prefilled once per group
(its n samples share it), a continuation prefills only the previous turn's last token (decode had not written
its K/V) and the observation, so a multi-turn run prefills exactly (B / n) * P + B * (K - 1) * (O + 1) tokens
and a single-turn run (B / n) * P. What differs besides that prefill: the kept sessions decode in the slot
layout (every sample reads its own copy of the prompt's K/V) after the first turn, and the contexts are
(K - 1) * O tokens longer by the last turn.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import time

import torch

from rlbench.configs.engine import TorchEngineConfig
from rlbench.engine.protocol import SamplingParams
from rlbench.engine.torch_engine import TorchEngine
from rlbench.models import build_model

DEFAULTS = {
    "cuda": dict(preset="qwen3-0.6b-shape", batch=64, n=8, prompt_len=512, turns=4, turn_tokens=128, obs_tokens=64),
    # a few seconds per run on a shared 2-core CPU (the GPU shape takes minutes there)
    "cpu": dict(preset="tiny", batch=16, n=4, prompt_len=64, turns=3, turn_tokens=32, obs_tokens=16),
}
"""Per device, what the flags left out take."""
TURN_SEED = 1_000_003
"""Turn t's seeds are offset by t * TURN_SEED (as `rlbench.rollout.multiturn`'s): no two turns sample alike."""


@dataclasses.dataclass(frozen=True)
class Shape:
    """The workload's sizes."""

    batch: int
    """Samples per call (B)."""
    n: int
    """Samples per prompt; B / n prompts."""
    prompt_len: int
    """Prompt tokens (P)."""
    turns: int
    """Generation turns of the multi-turn variant (K)."""
    turn_tokens: int
    """Tokens generated per turn (T); the single-turn variant generates K * T."""
    obs_tokens: int
    """Observation tokens appended before each turn after the first (O)."""

    def __post_init__(self) -> None:
        if self.n < 1 or self.batch < 1 or self.batch % self.n:
            raise ValueError(f"--batch {self.batch} must be a positive multiple of --n {self.n} (B = prompts x n)")
        if min(self.prompt_len, self.turns, self.turn_tokens) < 1 or self.obs_tokens < 0:
            raise ValueError(f"prompt_len={self.prompt_len}, turns={self.turns}, turn_tokens={self.turn_tokens} must "
                             f"be >= 1 and obs_tokens={self.obs_tokens} >= 0")

    @property
    def prompts(self) -> int:
        return self.batch // self.n

    @property
    def max_seq_len(self) -> int:
        """The longest multi-turn context, and one position to spare (a turn needs room after its observation)."""
        return self.prompt_len + self.turns * self.turn_tokens + (self.turns - 1) * self.obs_tokens + 1

    def expected_prefill(self, multi: bool) -> int:
        """Tokens the engine prefills: each prompt once; per continuation the last sampled token and O."""
        return self.prompts * self.prompt_len + multi * self.batch * (self.turns - 1) * (self.obs_tokens + 1)


def engine_config(shape: Shape, cuda: bool) -> TorchEngineConfig:
    """The trainer's engine config for this batch (`rlbench.orchestration.local.engine_config`): the defaults,
    slots sized from memory up to B on CUDA, B on CPU."""
    if cuda:
        return TorchEngineConfig(max_seq_len=shape.max_seq_len, max_slots=shape.batch)
    return TorchEngineConfig(max_seq_len=shape.max_seq_len, num_slots=shape.batch)


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def timed(fn, cuda: bool):
    """`(fn(), seconds)` with the device idle before and after."""
    _sync(cuda)
    t0 = time.perf_counter()
    out = fn()
    _sync(cuda)
    return out, time.perf_counter() - t0


def single_turn(engine: TorchEngine, shape: Shape, prompts, obs, cuda: bool) -> dict:
    """One `generate` of K*T tokens per sample: generated tokens, prefill tokens, wall."""
    sampling = SamplingParams(temperature=1.0, max_new_tokens=shape.turns * shape.turn_tokens, n=shape.n,
                              ignore_eos=True, seed=0)
    before = engine.runner.prefilled_tokens
    gens, wall = timed(lambda: engine.generate(prompts, sampling), cuda)
    return {"wall_s": wall, "turn_walls_s": [wall], "generated_tokens": sum(len(g.token_ids) for g in gens),
            "prefill_tokens": engine.runner.prefilled_tokens - before}


def multi_turn(engine: TorchEngine, shape: Shape, prompts, obs, cuda: bool) -> dict:
    """K turns of T tokens on kept sessions, `obs` appended before each turn after the first."""
    sampling = SamplingParams(temperature=1.0, max_new_tokens=shape.turn_tokens, n=shape.n, ignore_eos=True, seed=0)
    before = engine.runner.prefilled_tokens
    gens, wall = timed(lambda: engine.generate(prompts, sampling, keep=shape.turns > 1), cuda)
    walls, generated = [wall], sum(len(g.token_ids) for g in gens)
    one = dataclasses.replace(sampling, n=1)
    for t in range(1, shape.turns):
        sessions = [g.session for g in gens]
        seeds = [t * TURN_SEED + i for i in range(len(sessions))]
        gens, wall = timed(functools.partial(engine.continue_, sessions, [obs] * len(sessions), one, seeds=seeds,
                                             keep=t < shape.turns - 1), cuda)
        walls.append(wall)
        generated += sum(len(g.token_ids) for g in gens)
    assert not engine.sessions, "the last turn (keep=False) closes every session"
    return {"wall_s": sum(walls), "turn_walls_s": walls, "generated_tokens": generated,
            "prefill_tokens": engine.runner.prefilled_tokens - before}


VARIANTS = {"single_turn": single_turn, "multi_turn": multi_turn}


def measure(engine: TorchEngine, shape: Shape, prompts, obs, repeats: int, cuda: bool) -> dict[str, dict]:
    """Per variant: the untimed first run's wall, then the medians of `repeats` runs (interleaved, so a drift of
    the machine hits both alike)."""
    runs = {name: [] for name in VARIANTS}
    first = {name: fn(engine, shape, prompts, obs, cuda)["wall_s"] for name, fn in VARIANTS.items()}
    for _ in range(repeats):
        for name, fn in VARIANTS.items():
            runs[name].append(fn(engine, shape, prompts, obs, cuda))
    rows = {}
    for name, rs in runs.items():
        wall = statistics.median(r["wall_s"] for r in rs)
        turns = [statistics.median(r["turn_walls_s"][t] for r in rs) for t in range(len(rs[0]["turn_walls_s"]))]
        generated, prefill = rs[0]["generated_tokens"], rs[0]["prefill_tokens"]
        assert all((r["generated_tokens"], r["prefill_tokens"]) == (generated, prefill) for r in rs)
        rows[name] = {"first_s": first[name], "wall_s": wall, "walls_s": [r["wall_s"] for r in rs],
                      "turn_walls_s": turns, "generated_tokens": generated, "tokens_per_s": generated / wall,
                      "prefill_tokens": prefill, "expected_prefill_tokens": shape.expected_prefill(name == "multi_turn")}
    return rows


def table(result: dict) -> str:
    """Markdown: one column per variant."""
    rows, names = result["rows"], list(VARIANTS)
    lines = [("generated tokens", lambda r: f"{r['generated_tokens']:,}"),
             ("generated tokens/s", lambda r: f"{r['tokens_per_s']:,.0f}"),
             ("wall (median) s", lambda r: f"{r['wall_s']:.3f}"),
             ("first run (compile, capture) s", lambda r: f"{r['first_s']:.3f}"),
             ("wall per turn s", lambda r: " / ".join(f"{w:.3f}" for w in r["turn_walls_s"])),
             ("prefill tokens (expected)", lambda r: f"{r['prefill_tokens']:,} ({r['expected_prefill_tokens']:,})")]
    out = ["| | " + " | ".join(names) + " |", "|---" * (1 + len(names)) + "|"]
    out += [f"| {label} | " + " | ".join(get(rows[n]) for n in names) + " |" for label, get in lines]
    out.append(f"| tokens/s multi / single | {result['ratio']:.3f} | |")
    return "\n".join(out)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--preset", help="model preset (default: qwen3-0.6b-shape on cuda, tiny on cpu)")
    p.add_argument("--batch", type=int, help="samples per call, B = prompts x n (default: 64 cuda, 16 cpu)")
    p.add_argument("--n", type=int, help="samples per prompt (default: 8 cuda, 4 cpu)")
    p.add_argument("--prompt-len", type=int, help="prompt tokens P (default: 512 cuda, 64 cpu)")
    p.add_argument("--turns", type=int, help="turns K (default: 4 cuda, 3 cpu)")
    p.add_argument("--turn-tokens", type=int, help="tokens generated per turn T (default: 128 cuda, 32 cpu)")
    p.add_argument("--obs-tokens", type=int, help="observation tokens O between turns (default: 64 cuda, 16 cpu)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per variant after the untimed first")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--out", default=None, help="JSON file")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats}: time at least one run")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here; use --device cpu")
    for name, value in DEFAULTS[args.device].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = Shape(args.batch, args.n, args.prompt_len, args.turns, args.turn_tokens, args.obs_tokens)
    cuda = args.device == "cuda"
    preset = args.preset
    model = build_model(preset, device=args.device, dtype=torch.bfloat16 if cuda else torch.float32)
    engine = TorchEngine(model, engine_config(shape, cuda))
    if engine.cache.shape.num_slots < shape.batch:
        raise ValueError(f"the KV cache holds {engine.cache.shape.num_slots} slots, the sessions need --batch "
                         f"{shape.batch}: lower --batch or the lengths")
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = torch.randint(0, vocab, (shape.prompts, shape.prompt_len), generator=g).tolist()
    obs = torch.randint(0, vocab, (shape.obs_tokens,), generator=g).tolist()
    rows = measure(engine, shape, prompts, obs, args.repeats, cuda)
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "preset": preset, "num_params": sum(p.numel() for p in model.parameters()),
              "shape": dataclasses.asdict(shape), "engine": dataclasses.asdict(engine.cfg),
              "num_slots": engine.cache.shape.num_slots, "repeats": args.repeats, "rows": rows,
              "ratio": rows["multi_turn"]["tokens_per_s"] / rows["single_turn"]["tokens_per_s"]}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"\n{preset} on {result['device']}: {shape.prompts} prompts x {shape.n}, P={shape.prompt_len}, "
          f"K={shape.turns} turns x T={shape.turn_tokens}, O={shape.obs_tokens}; median of {args.repeats}\n")
    print(table(result), flush=True)
    return result


if __name__ == "__main__":
    main()
