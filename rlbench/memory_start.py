"""The start-up memory plan: before any weights load, decide from the model's config, the run config and the
device's memory what fits, and refuse at once when nothing does.

    plan = plan_at_start(cfg, hf_config, DeviceMemory(total, free), shortest_prompt=510)
    plan.config          # cfg with the open knobs filled in (what the backend, the engine and the Trainer build)
    plan.lines()         # one line per decision: what it chose and why (GiB)

Sizes per rank, from the config alone (`parameter_counts` builds the model on the meta device): the trainer
state (fp32 parameter shards + AdamW's two moments, sharded over the ranks; with PPO the critic's too), the
fp32 gradients (unsharded while `no_sync_accumulation` accumulates them), the parameters FSDP keeps gathered
(the root's; every layer's without `reshard_after_forward`), the engine's own copy of the weights, its KV cache
(`engine.num_slots` slots of `max_seq_len` tokens), and one training micro-batch (`micro_batch_bytes`:
activations, and logits for the response rows only). The binding phase is training: everything resident, less
the KV cache when engine and trainer take turns (`RunConfig.offload`), less the trainer state and gradients
with FSDP's CPU offload (`fsdp.cpu_offload`).

The knobs the user left open (None, or for the token budget: below the `max_tokens_per_gpu` cap) are chosen
in a fixed order of cost, cheapest first: the full budget, a lower budget (down to `MIN_BUDGET` tokens),
activation checkpointing, offload turns, a budget under `MIN_BUDGET` (down to one longest sample), and last
FSDP's CPU offload (an AdamW step on the CPU). The first choice whose training phase fits the free memory
(less `RESERVE`, transients times `MARGIN`) wins. A knob the user set is kept; when no allowed choice fits,
`plan_at_start` raises `ValueError` naming the flags and the numbers, before anything is built. On the CPU
(host memory) nothing is planned: open knobs take their old defaults (off, the full budget).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

import torch

from rlbench.memory_plan import GIB, MARGIN, RESERVE, micro_batch_bytes

MIN_BUDGET = 2048
"""Tokens per micro-batch below which the plan prefers offload turns to a smaller budget: fewer tokens make
thinner GEMMs and more per-micro-batch parameter casts/gathers, while a turn costs a fixed park/unpark."""


@dataclass(frozen=True)
class DeviceMemory:
    """One device's memory in bytes (`torch.cuda.mem_get_info`: free now, total)."""

    total: int
    free: int


def device_memory(device: torch.device) -> DeviceMemory | None:
    """The CUDA device's memory now; None for the CPU (host memory is not planned)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(total, free)


COUNTS: dict[str, tuple[int, int, int]] = {}
"""`parameter_counts` by config (JSON): a model is built on the meta device once per process."""


def parameter_counts(hf_config) -> tuple[int, int, int]:
    """`(parameters, parameters of one decoder layer, decoder layers)` of the causal LM of `hf_config` (built on
    the meta device: no memory, any architecture transformers knows)."""
    key = hf_config.to_json_string(use_diff=False)
    if key not in COUNTS:
        from rlbench.models.vlm import auto_model_class  # a VLM: AutoModelForImageTextToText

        with torch.device("meta"):
            model = auto_model_class(hf_config).from_config(hf_config)
        total = sum(p.numel() for p in model.parameters())
        layer = sum(p.numel() for n, p in model.named_parameters() if ".layers.0." in n)  # a decoder layer
        COUNTS[key] = (total, layer, hf_config.get_text_config().num_hidden_layers)
    return COUNTS[key]


@dataclass(frozen=True)
class Choice:
    """One setting of the knobs the plan decides."""

    checkpointing: bool
    tokens: int
    """tokens of one rank's largest training micro-batch"""
    turns: bool
    """engine and trainer take turns (`RunConfig.offload`): the KV cache is freed while training"""
    cpu_offload: bool

    def cost(self, floor: int) -> tuple:
        """Sort key: lower is cheaper (see the module docstring for the order)."""
        return (self.cpu_offload, self.tokens < floor, self.turns, self.checkpointing, -self.tokens)


@dataclass
class StartPlan:
    """The decisions and the sizes behind them (bytes per rank)."""

    config: object
    """the RunConfig with the plan's decisions filled in"""
    memory: DeviceMemory | None
    choice: Choice | None
    """None on the CPU (nothing planned)"""
    sizes: dict = field(default_factory=dict)
    """state, grads, gathered, engine_weights, kv_cache, kv_slots, params, world"""
    need: dict = field(default_factory=dict)
    """the chosen setting's training-phase bytes by part, and `total`"""
    decided: tuple[str, ...] = ()
    """the knobs the user left open ("checkpointing", "tokens", "turns", "cpu_offload", "kv_slots")"""
    logit_share: float = 1.0
    """response rows per micro-batch token (the logits' rows), from the shortest prompt"""
    notes: dict = field(default_factory=dict)
    """knob -> why it was chosen (one line each)"""

    def lines(self) -> list[str]:
        """One line for the sizes, then one per decision."""
        if self.choice is None:
            return ["memory plan (cpu): host memory, nothing planned"]
        s, m = self.sizes, self.memory
        head = (f"memory plan (cuda, {gib(m.total)} GiB, {gib(m.free)} free at start, {s['world']} rank"
                f"{'s' if s['world'] > 1 else ''}): {s['params'] / 1e9:.2f}B params; trainer state {gib(s['state'])}"
                f" GiB, grads {gib(s['grads'])} GiB, engine weights {gib(s['engine_weights'])} GiB, KV cache "
                f"{gib(s['kv_cache'])} GiB ({s['kv_slots']} slots); training phase needs ~{gib(self.need['total'])} "
                f"GiB of {gib(m.free - RESERVE)} usable")
        return [head, *(f"memory plan: {self.notes[k]}" for k in ("kv_slots", "checkpointing", "tokens", "turns",
                                                                  "cpu_offload") if k in self.notes)]


def gib(x: float) -> str:
    return f"{x / GIB:.1f}"


def plan_at_start(cfg, hf_config, memory: DeviceMemory | None, *, shortest_prompt: int | None = None,
                  world: int = 1) -> StartPlan:
    """Decide the open memory knobs of `cfg` for a device of `memory` (None: the CPU).

    Args:
        cfg: the RunConfig (FSDP backend, torch engine, one process per GPU).
        hf_config: the policy's HF config (`rlbench.backends.hf_weights.model_config`).
        memory: the device's total and free bytes before anything is built; None plans nothing.
        shortest_prompt: the shortest training prompt (tokens); bounds the response rows of a micro-batch.
            None: every token may be a response token.
        world: trainer ranks FSDP shards the state over.
    Returns:
        the plan; `plan.config` is `cfg` with the decisions filled in.
    Raises:
        ValueError: no allowed choice fits; the message names the flags to change and the numbers.
    """
    f = cfg.backend.fsdp
    if memory is None:
        fsdp = dataclasses.replace(f, gradient_checkpointing=bool(f.gradient_checkpointing),
                                   cpu_offload=bool(f.cpu_offload))
        return StartPlan(cfg.replace(backend=dataclasses.replace(cfg.backend, fsdp=fsdp)), None, None)
    r = cfg.rollout
    share = 1.0 if not shortest_prompt else min(1.0, r.max_response_len / (r.max_response_len + shortest_prompt))
    sizes = _sizes(cfg, hf_config, world)
    est = _Estimator(cfg, hf_config, sizes, share, memory.free - RESERVE)
    options = _options(cfg)
    choices = sorted((Choice(*c) for c in itertools.product(*options.values())),
                     key=lambda c: c.cost(est.floor))
    best = next((c for c in choices if est.fits(c)), None)
    if best is None:
        raise ValueError(_refusal(cfg, est, options, memory))
    plan = StartPlan(_apply(cfg, best, sizes), memory, best, sizes, est.need(best), _open(cfg), share)
    plan.notes = _notes(cfg, est, best, options)
    return plan


def _sizes(cfg, hf_config, world: int) -> dict:
    """Knob-independent bytes per rank."""
    params, layer, layers = parameter_counts(hf_config)
    critic = 0
    if cfg.backend.critic is not None:  # the critic's decoder (its LM head is dropped for a 1-wide value head)
        from rlbench.backends.hf_weights import model_config

        critic = parameter_counts(model_config(cfg.backend.critic.load or cfg.backend.model,
                                               cfg.backend.model_overrides))[0]
    compute = _dtype_bytes(cfg.backend.param_dtype)
    engine_dtype = _dtype_bytes(cfg.engine.dtype or cfg.backend.param_dtype)
    f = cfg.backend.fsdp
    gathered_layers = layers if not f.reshard_after_forward else 2  # the running layer and the prefetched one
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config  # a VLM's decoder
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", text.num_attention_heads)
    from rlbench.engine.kv_cache import KV_PAD  # a constant: no kernels load

    slot = 2 * layers * kv_heads * head_dim * (cfg.engine.max_seq_len + KV_PAD) * engine_dtype
    slots = cfg.engine.num_slots or min(cfg.engine.max_slots, cfg.rollout.prompts_per_round * cfg.rollout.n_samples_per_prompt)
    shard = (params + critic) * 4 // world
    return {
        "params": params, "world": world,
        "state": 3 * shard,  # fp32 parameter shards + AdamW exp_avg, exp_avg_sq
        "grads": (params + critic) * 4 if f.no_sync_accumulation and world > 1 else shard,
        "gathered": compute * ((params - layers * layer) + gathered_layers * layer),
        "engine_weights": params * engine_dtype,
        "kv_slot": slot, "kv_slots": slots, "kv_cache": slots * slot,
    }


def _dtype_bytes(name: str) -> int:
    return {"bf16": 2, "fp16": 2, "fp32": 4}[name]


class _Estimator:
    """The training phase's bytes for a choice, against the usable memory."""

    def __init__(self, cfg, hf_config, sizes: dict, share: float, usable: int) -> None:
        self.cfg, self.hf_config, self.sizes, self.share, self.usable = cfg, hf_config, sizes, share, usable
        self.longest = cfg.engine.max_seq_len
        self.floor = max(MIN_BUDGET, self.longest)

    def need(self, c: Choice) -> dict:
        s, f = self.sizes, self.cfg.backend.fsdp
        mb = micro_batch_bytes(self.hf_config, c.tokens, checkpointing=c.checkpointing,
                               dtype_bytes=_dtype_bytes(self.cfg.backend.param_dtype),
                               checkpoint_every=f.checkpoint_every, logit_rows=round(c.tokens * self.share))
        parts = {"state": 0 if c.cpu_offload else s["state"], "grads": 0 if c.cpu_offload else s["grads"],
                 "gathered": s["gathered"], "engine_weights": s["engine_weights"],
                 "kv_cache": 0 if c.turns else s["kv_cache"],
                 "activations": int(MARGIN * mb["activations"]), "logits": int(MARGIN * mb["logits"])}
        return parts | {"total": sum(parts.values())}

    def fits(self, c: Choice) -> bool:
        return self.need(c)["total"] <= self.usable


def _budgets(cfg) -> list[int]:
    """Token budgets to try: the cap (`max_tokens_per_gpu`), halved down to one longest sample (`max_seq_len`);
    the static micro-batch size's worst case when batches are not packed by tokens."""
    b = cfg.batch
    if not b.use_dynamic_batch_size:
        return [b.micro_batch_size * cfg.engine.max_seq_len]
    cap, low = b.max_tokens_per_gpu, min(b.max_tokens_per_gpu, cfg.engine.max_seq_len)
    out = [cap]
    while out[-1] // 2 > low:
        out.append(out[-1] // 2 // 16 * 16)
    return out + ([low] if out[-1] != low else [])


def _options(cfg) -> dict[str, tuple]:
    """Each knob's allowed values: the user's when set, else both."""
    f = cfg.backend.fsdp

    def knob(value):
        return (False, True) if value is None else (bool(value),)

    return {"checkpointing": knob(f.gradient_checkpointing), "tokens": tuple(_budgets(cfg)),
            "turns": knob(cfg.offload), "cpu_offload": knob(f.cpu_offload)}


def _open(cfg) -> tuple[str, ...]:
    f, out = cfg.backend.fsdp, []
    for name, value in (("checkpointing", f.gradient_checkpointing), ("turns", cfg.offload),
                        ("cpu_offload", f.cpu_offload), ("kv_slots", cfg.engine.num_slots)):
        if value is None:
            out.append(name)
    return (*out, "tokens") if cfg.batch.use_dynamic_batch_size else tuple(out)


def _apply(cfg, c: Choice, sizes: dict):
    """`cfg` with the choice written into its fields (the user's values are the choice's already)."""
    fsdp = dataclasses.replace(cfg.backend.fsdp, gradient_checkpointing=c.checkpointing, cpu_offload=c.cpu_offload)
    batch = cfg.batch
    if batch.use_dynamic_batch_size:
        batch = dataclasses.replace(batch, max_tokens_per_gpu=c.tokens)
    engine = dataclasses.replace(cfg.engine, num_slots=sizes["kv_slots"])
    return cfg.replace(backend=dataclasses.replace(cfg.backend, fsdp=fsdp), batch=batch, engine=engine, offload=c.turns)


FLAGS = {"checkpointing": ("--gradient-checkpointing", "--no-gradient-checkpointing"),
         "turns": ("--offload", "--no-offload"), "cpu_offload": ("--fsdp-cpu-offload", "--no-fsdp-cpu-offload")}
"""knob -> (its flag on, off)."""
WORDS = {"checkpointing": "activation checkpointing", "turns": "offload turns (engine and trainer take turns)",
         "cpu_offload": "FSDP CPU offload (params, grads, AdamW on the CPU)"}

OFF_WHY = {"checkpointing": "the micro-batch fits without it", "turns": "training fits beside the engine's KV cache",
           "cpu_offload": "the trainer state fits on the device"}


def _given(cfg, knob: str) -> str:
    value = {"checkpointing": cfg.backend.fsdp.gradient_checkpointing, "turns": cfg.offload,
             "cpu_offload": cfg.backend.fsdp.cpu_offload}[knob]
    return FLAGS[knob][0 if value else 1]


def _notes(cfg, est: _Estimator, best: Choice, options: dict) -> dict:
    """knob -> one line: what was chosen and why."""
    notes = {}
    s, usable = est.sizes, est.usable
    if cfg.engine.num_slots is None:
        r = cfg.rollout
        notes["kv_slots"] = (f"KV cache {s['kv_slots']} slots = the rollout's live samples ({r.prompts_per_round} "
                             f"prompts x {r.n_samples_per_prompt}) at {cfg.engine.max_seq_len} tokens: "
                             f"{gib(s['kv_cache'])} GiB")
    for knob in ("checkpointing", "turns", "cpu_offload"):
        on = getattr(best, knob)
        if len(options[knob]) == 1:
            notes[knob] = f"{WORDS[knob]} {'on' if on else 'off'} (given: {_given(cfg, knob)})"
        elif not on:
            notes[knob] = f"{WORDS[knob]} off: {OFF_WHY[knob]}"
        else:
            without = dataclasses.replace(best, **{knob: False})
            notes[knob] = (f"{WORDS[knob]} on: without it {_what(without)} needs ~{gib(est.need(without)['total'])} "
                           f"GiB of {gib(usable)} usable")
    if cfg.batch.use_dynamic_batch_size:
        cap = cfg.batch.max_tokens_per_gpu
        if best.tokens == cap:
            notes["tokens"] = f"micro-batch budget {cap} tokens (--max-tokens-per-gpu {cap}): fits"
        else:
            full = dataclasses.replace(best, tokens=cap)
            notes["tokens"] = (f"micro-batch budget {best.tokens} tokens, under --max-tokens-per-gpu {cap}: {cap} "
                               f"tokens with {_setting(best)} need ~{gib(est.need(full)['total'])} GiB of "
                               f"{gib(usable)} usable")
    return notes


def _setting(c: Choice) -> str:
    words = [("AC" if c.checkpointing else "no AC")]
    words += ["offload turns"] if c.turns else []
    words += ["FSDP CPU offload"] if c.cpu_offload else []
    return ", ".join(words)


def _what(c: Choice) -> str:
    return f"a micro-batch of {c.tokens} tokens ({_setting(c)})"


def _refusal(cfg, est: _Estimator, options: dict, memory: DeviceMemory) -> str:
    """Why nothing fits, and the fewest flags to change (each alternative with what then fits)."""
    allowed = min((Choice(*c) for c in itertools.product(*options.values())), key=lambda c: est.need(c)["total"])
    given = [k for k in FLAGS if len(options[k]) == 1]
    head = (f"{' '.join(_given(cfg, k) for k in given) + ': ' if given else ''}nothing fits on this GPU "
            f"({gib(memory.total)} GiB, {gib(memory.free)} free, {gib(est.usable)} usable): even {_what(allowed)} "
            f"needs ~{gib(est.need(allowed)['total'])} GiB")
    for size in range(1, len(given) + 1):
        fixes = []
        for relax in itertools.combinations(given, size):
            relaxed = {**options, **{k: (False, True) for k in relax}}
            fit = next((c for c in sorted((Choice(*c) for c in itertools.product(*relaxed.values())),
                                          key=lambda c: c.cost(est.floor)) if est.fits(c)), None)
            if fit is not None and all(getattr(fit, k) != options[k][0] for k in relax):
                flags = " ".join(FLAGS[k][0 if getattr(fit, k) else 1] for k in relax)
                fixes.append(f"{flags} (then {_what(fit)} fits in ~{gib(est.need(fit)['total'])} GiB)")
        if fixes:
            return f"{head}; use {' or '.join(fixes)}"
    return (f"{head}, with every memory option allowed: the trainer state alone is {gib(est.sizes['state'])} GiB. "
            "Use more GPUs (FSDP shards the state over them), a smaller model, or a smaller KV cache "
            "(--rollout-batch-size, --n-samples-per-prompt, --engine-max-seq-len)")

GAP = 0.10
"""A measured size differing from the start-up estimate by more than this share (and `GAP_BYTES`) is reported."""
GAP_BYTES = GIB


def measured_gap(plan: StartPlan, measured) -> str | None:
    """What the measured plan (`rlbench.memory_plan.MemoryPlan`, both sides built) shows that the start-up
    estimate did not: one line naming each size off by more than `GAP` and `GAP_BYTES`, or None."""
    c, s, m = plan.choice, plan.sizes, plan.memory
    resident = {"trainer state": 0 if c.cpu_offload else s["state"], "engine weights": s["engine_weights"],
                "KV cache": s["kv_cache"]}
    pairs = {"trainer state": (resident["trainer state"], measured.trainer_state),
             "engine weights": (resident["engine weights"], measured.engine_weights),
             "KV cache": (resident["KV cache"], measured.kv_cache),
             "free memory": (m.free - sum(resident.values()), measured.free)}
    off = [f"{name} {gib(got)} GiB (estimated {gib(want)})" for name, (want, got) in pairs.items()
           if got is not None and abs(got - want) > max(GAP_BYTES, GAP * abs(want))]
    return ("measured " + ", ".join(off) + " after the build") if off else None
