"""The whole GRPO loop a user runs, measured: rlbench's `Trainer` beside TRL's `GRPOTrainer` on the same workload.

    rlbench bench e2e                                   # 0.6B shape on one GPU, TRL too when importable
    rlbench bench e2e --preset qwen3-4b-shape --no-trl  # 16384-token cap; AC, budget, offload: the memory plan's
    rlbench bench e2e --preset qwen3-4b-shape --max-tokens-per-gpu 8192 --gradient-checkpointing   # set by hand
    python benchmarks/e2e.py --preset cpu-tiny --threads 2 --steps 3   # the CPU workload, rlbench vs TRL
    rlbench bench e2e --ppo --no-trl                    # PPO with a critic (rlbench-ppo) beside GRPO (rlbench)

The workload (`WORKLOADS`): a randomly initialised model of a preset shape saved as a Hugging Face directory
(weights + a tokenizer both systems load), `prompts` x `n` samples of `prompt_len`-token prompts and exactly
`response_len` new tokens (rlbench `ignore_eos`, TRL `min_new_tokens`: the same work in both), a deterministic
reward of the response text shared by both, GRPO with one optimizer step per rollout (global batch =
prompts x n), the same lr and AdamW betas. TRL runs as documented for one GPU: HF `generate`, gradient
checkpointing, beta=0. Each system runs in a fresh process (its first step is a real cold start).

Per system: build time (load the HF dir, build the trainer), the first step, the steady step (median of the
`--steps` after the first), their difference (compile, CUDA-graph capture, allocator warm-up), per-phase
times and peak memory (rlbench: rollout, log-probs, train, sync, other = the rest of the step: scoring,
packing, offload; TRL: rollout = `_generate_and_score_completions`, train = the rest of the step), rollout
tokens/s (generated tokens / rollout time), and MFU = model FLOPs / time / the device's dense bf16 peak
(`rlbench.trainer.PEAK_FLOPS`; "n/a" elsewhere): rollout 2*N*generated tokens, log-probs 2*N*tokens,
train and whole step 6*N*tokens (N = parameters, tokens = prompt + response tokens of the step; log-probs: the
tokens the old/ref passes ran over, `perf/log_probs_tokens`), and the graphs torch.compile built after the first
step (`perf/compiles`: 0 when nothing recompiles).

`--ppo` adds the system "rlbench-ppo": the defaults with `advantage_estimator="gae"`, so the default critic (the
actor's shape with a value head) is built, trained and offloaded beside the actor on the same device. Its two more
phases: values (`perf/values_time`, the critic's forward over the packs, MFU 2*Nc*`perf/values_tokens`) and
critic_train (`perf/critic_train_time`, MFU 6*Nc*tokens; Nc = the critic's parameters); train stays the actor's
update. The trainer reads no separate critic peak: the values pass falls in the log_probs peak, the critic update
in the train peak, and the step MFU counts the actor's 6*N*tokens only (the same useful work as GRPO's).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ("rollout", "log_probs", "values", "train", "critic_train", "sync", "other")
PHASE_KEYS = {"rollout": "perf/rollout_time", "log_probs": "perf/log_probs_time", "values": "perf/values_time",
              "train": "perf/train_time", "critic_train": "perf/critic_train_time",
              "sync": "perf/update_weights_time", "offload": "perf/offload_time"}
CRITIC_PHASES = ("values", "critic_train")
"""Phases only a run with a critic has (PPO, `rlbench-ppo`): absent ("—"), not 0, for the others."""
PEAK_KEYS = {"rollout": "perf/rollout_peak_memory_gb", "log_probs": "perf/log_probs_peak_memory_gb",
             "train": "perf/train_peak_memory_gb", "sync": "perf/update_weights_peak_memory_gb"}
PROMPT_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 +-*/="
TRL_HINT = "pip install trl==1.16.0 datasets (GPU machine: the wheels in .whl/, docs/LOG.md)"


@dataclass
class Workload:
    """One e2e workload: the model shape, the batch, the lengths and the numerics."""

    model: str
    """Model preset (`rlbench.models.presets.PRESETS`), randomly initialised and saved as an HF directory."""
    device: str
    """"cuda" or "cpu"."""
    dtype: str
    """"bf16" or "fp32": the saved weights, rlbench's param dtype, TRL's `bf16` flag."""
    prompts: int = 8
    """Prompts (groups) per rollout."""
    n: int = 8
    """Samples per prompt (the GRPO group; TRL's num_generations)."""
    prompt_len: int = 510
    """Tokens per prompt (one character each)."""
    response_len: int = 256
    """New tokens per sample, forced (no early stop)."""
    vocab_size: int = 151936
    """Model and tokenizer vocabulary."""
    lr: float = 1e-6
    """AdamW learning rate of both systems."""
    max_tokens_per_gpu: int = 16384
    """rlbench's packed micro-batch token budget."""
    gradient_checkpointing: bool | None = None
    """rlbench's activation checkpointing (TRL always checkpoints); None: rlbench's start-up memory plan decides."""
    trl_micro_batch: int | None = None
    """TRL's per_device_train_batch_size (gradient accumulation makes up the global batch); None: n."""

    def __post_init__(self) -> None:
        if self.device not in ("cuda", "cpu") or self.dtype not in ("bf16", "fp32"):
            raise ValueError(f"device={self.device!r} / dtype={self.dtype!r}: use cuda|cpu and bf16|fp32")
        if (self.prompts * self.n) % self.trl_batch:
            raise ValueError(f"prompts x n = {self.prompts * self.n} must be a multiple of trl_micro_batch="
                             f"{self.trl_batch}; change --trl-micro-batch")
        if self.n < 2:
            raise ValueError(f"n={self.n}: GRPO needs at least 2 samples per prompt")

    @property
    def trl_batch(self) -> int:
        return self.trl_micro_batch or self.n


WORKLOADS = {
    "qwen3-0.6b-shape": Workload(model="qwen3-0.6b-shape", device="cuda", dtype="bf16"),
    # issue 50's 4B target: --max-tokens-per-gpu 16384 alone, the memory plan choosing AC, budget and offload
    "qwen3-4b-shape": Workload(model="qwen3-4b-shape", device="cuda", dtype="bf16"),
    # a Qwen3-MoE scaled to ~0.68 B parameters (64 experts, 8 per token; rlbench.models.presets), rlbench only:
    # the engine's MoE layer (dense expert schedule at decode) and MoE training
    "qwen3-moe-0.6b-shape": Workload(model="qwen3-moe-0.6b-shape", device="cuda", dtype="bf16"),
    # the CPU workload: a tiny Qwen3 (hidden 64, 2 layers) with the real 152k vocabulary
    "cpu-tiny": Workload(model="tiny", device="cpu", dtype="fp32", prompt_len=30, response_len=16, lr=1e-5),
}


def text_reward(response: str, label=None) -> float:
    """Differs between samples of a group (random models): non-zero advantages, real updates."""
    return (sum(map(ord, response)) % 7) / 6


def bench_tokenizer(vocab_size: int):
    """The presets' character tokenizer (`rlbench.data.tokenizer`) with ordinary filler tokens `<k>` up to
    `vocab_size`: prompts encode one character per token, and every id a random model samples decodes to
    text (the reward sees it), in both systems."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from rlbench.data import tokenizer as chars

    vocab = {c: i for i, c in enumerate(chars.alphabet())}
    vocab[chars.UNK_TOKEN] = len(vocab)
    for k in range(vocab_size - len(vocab) - len(chars.SPECIAL_TOKENS)):
        vocab[f"<{k}>"] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=chars.UNK_TOKEN))  # no merges: one char each
    core.decoder = decoders.Fuse()
    core.add_special_tokens(list(chars.SPECIAL_TOKENS))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token=chars.UNK_TOKEN, pad_token=chars.PAD_TOKEN,
                                  eos_token=chars.IM_END, chat_template=chars.CHAT_TEMPLATE,
                                  clean_up_tokenization_spaces=False)
    assert len(tok) == vocab_size, (len(tok), vocab_size)
    return tok


def write_model_dir(w: Workload, path: str) -> str:
    """Save a random `w.model` (and `bench_tokenizer`) to `path` unless an HF directory is already there."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    import torch

    from rlbench.models import build_model, save_pretrained

    tok = bench_tokenizer(w.vocab_size)
    dtype = torch.bfloat16 if w.dtype == "bf16" else torch.float32
    model = build_model(w.model, device=w.device, dtype=dtype, vocab_size=w.vocab_size, bos_token_id=None,
                        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    save_pretrained(model, tok, path)
    del model  # the systems run in child processes: this one keeps no device memory while they do
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return path


def prompt_texts(w: Workload, rollouts: int) -> list[str]:
    """`prompts x rollouts` random prompts of `prompt_len` characters (the same for both systems)."""
    rng = random.Random(0)
    return ["".join(rng.choice(PROMPT_CHARS) for _ in range(w.prompt_len)) for _ in range(w.prompts * rollouts)]


# ---------------------------------------------------------------------------------------------- rlbench
VARIANTS = {"rlbench": "defaults", "rlbench-fast": "fast", "rlbench-top": "true_on_policy", "rlbench-ppo": "ppo"}
"""rlbench's systems -> `rlbench_config` variants."""


def rlbench_config(w: Workload, model_dir: str, workdir: str, rollouts: int, variant: str = "defaults"):
    """The RunConfig of the workload: the one-GPU preset with the workload's batch, lengths and numerics.
    `variant` "fast": flex_attention, compiled engine and trainer (the GPU defaults too) and offload forced off (the
    defaults let the memory plan decide); "true_on_policy": the defaults with `true_on_policy_mode=True`; "ppo": the
    defaults with `advantage_estimator="gae"` (PPO with a critic: `RunConfig` adds the default critic, the actor's
    model with a value head, colocated on the same device and parked with the actor between turns)."""
    fast = variant == "fast"
    from rlbench import presets
    from rlbench.configs import EvalConfig, LoggingConfig
    from rlbench.data import write_jsonl

    data_path = os.path.join(workdir, "prompts.jsonl")
    write_jsonl([{"prompt": p, "label": "0"} for p in prompt_texts(w, rollouts)], data_path)
    base = presets.qwen3_0p6b_gpu(model=model_dir, workdir=workdir)
    backend = dataclasses.replace(base.backend, device=w.device, param_dtype=w.dtype,
                                  fsdp=dataclasses.replace(base.backend.fsdp, gradient_checkpointing=w.gradient_checkpointing),
                                  optim=dataclasses.replace(base.backend.optim, lr=w.lr))
    engine = dataclasses.replace(base.engine, max_seq_len=w.prompt_len + w.response_len + 16)
    if fast:
        backend = dataclasses.replace(backend, fsdp=dataclasses.replace(backend.fsdp, attn_implementation="flex_attention",
                                                                             compile=True))
        engine = dataclasses.replace(engine, compile=True)
    loss = dataclasses.replace(base.loss, advantage_estimator="gae") if variant == "ppo" else base.loss
    return base.replace(
        task=None, loss=loss, eval=EvalConfig(), logging=LoggingConfig(console=False), backend=backend, engine=engine,
        data=dataclasses.replace(base.data, path=data_path, metadata_key=None, apply_chat_template=False,
                                 shuffle=False),
        rollout=dataclasses.replace(base.rollout, rollout_batch_size=w.prompts, n_samples_per_prompt=w.n,
                                    max_response_len=w.response_len, rm_type="bench_text", ignore_eos=True),
        batch=dataclasses.replace(base.batch, global_batch_size=w.prompts * w.n, num_rollout=rollouts,
                                  max_tokens_per_gpu=w.max_tokens_per_gpu),
        offload=False if fast else None, true_on_policy_mode=variant == "true_on_policy",
    )


def profile_phases(trainer) -> str:
    """One more rollout and its train phase, each under `torch.profiler`: the top ops and kernels by device time
    (by CPU time without a GPU). The footer's CPU and device totals against the phase's wall time tell a
    host-bound phase from a device-bound one."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"

    def profiled(name, fn):
        with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
            t0 = time.perf_counter()
            out = fn()
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        averages = prof.key_averages()
        table = averages.table(sort_by=key, row_limit=30, max_name_column_width=80)
        if cuda:  # the host side too: a phase whose wall time exceeds its device time is bound here
            table += "\nby host time:\n" + averages.table(sort_by="self_cpu_time_total", row_limit=20,
                                                           max_name_column_width=80)
        return out, f"{name} phase wall {wall:.3f} s (under the profiler)\n{table}"

    batch, rollout_table = profiled("rollout", trainer.rollout)
    trainer.score(batch)
    trainer.pack(batch)
    trainer.compute_log_probs(batch, first_from_forward=True)
    _, train_table = profiled("train", lambda: trainer.train_step(batch))
    return f"{train_table}\n{rollout_table}"


def run_rlbench(w: Workload, model_dir: str, rollouts: int, variant: str = "defaults", profile: bool = False) -> dict:
    """Build the Trainer from the HF dir and run `rollouts` steps; per-step times, peaks and token counts
    (`profile`: then `profile_phases`)."""
    from rlbench import Trainer
    from rlbench.rewards import REWARDS

    REWARDS["bench_text"] = text_reward
    with tempfile.TemporaryDirectory(prefix="rlbench-e2e-") as workdir:
        cfg = rlbench_config(w, model_dir, workdir, rollouts, variant)
        t0 = time.perf_counter()
        trainer = Trainer(cfg)
        build_s = time.perf_counter() - t0
        print(f"[e2e] rlbench {variant}: built in {build_s:.1f} s", flush=True)
        history = []
        for i in range(rollouts):  # a line per step: a stalled step shows where it stalled
            history.append(trainer.step())
            m = history[-1]
            print(f"[e2e] rlbench {variant}: step {i + 1}/{rollouts} {m['perf/step_time']:.2f} s (rollout "
                  f"{m.get('perf/rollout_time', 0.0):.2f} s, train {m.get('perf/train_time', 0.0):.2f} s)", flush=True)
        caches = compile_cache_counts()
        phase_profiles = profile_phases(trainer) if profile else None
    steps = []
    for m in history:
        phases = {name: m.get(key, 0.0) for name, key in PHASE_KEYS.items() if key in m or name not in CRITIC_PHASES}
        phases["other"] = m["perf/step_time"] - sum(phases.values())
        steps.append({"step_s": m["perf/step_time"], "phases": phases,
                      "peaks_gb": {name: m[key] for name, key in PEAK_KEYS.items() if key in m},
                      "peak_gb": m.get("perf/peak_memory_gb"),
                      "tokens": round(m["perf/tokens_per_sec"] * m["perf/step_time"]),  # counts, as rates
                      "generated_tokens": round(m["perf/rollout_tokens_per_sec"] * m["perf/rollout_time"]),
                      "log_prob_tokens": m.get("perf/log_probs_tokens", 0.0) + m.get("perf/ref_log_probs_tokens", 0.0),
                      "values_tokens": m.get("perf/values_tokens"),
                      "compiles": m.get("perf/compiles"), "compile_s": m.get("perf/compile_time"),
                      "response_len": m["rollout/response_len/mean"],
                      "logprob_abs_diff": m.get("train/train_rollout_logprob_abs_diff"),
                      "first_mb_kl_vs_rollout": m.get("train/first_mb_kl_vs_rollout")})
    plan = trainer.memory_plan.summary() if trainer.memory_plan is not None else None
    start = trainer.start_plan.lines() if trainer.start_plan is not None else None
    critic = getattr(trainer.backend, "critic", None)  # FSDPActorCritic's value model (PPO)
    critic_params = sum(p.numel() for p in critic.model.parameters()) if critic is not None else None
    return {"build_s": build_s, "num_params": trainer.num_params, "critic_params": critic_params, "steps": steps,
            "profile": phase_profiles,
            "start_plan": start, "memory_plan": plan, "compile_caches": caches}


def compile_cache_counts() -> dict:
    """This process's inductor FX-graph and AOT-autograd cache hits / misses / bypasses (a warm-cache first step
    that still compiles for long shows here which cache missed)."""
    from torch._dynamo.utils import counters

    return {f"{group}/{k}": int(v) for group in ("inductor", "aot_autograd") for k, v in counters[group].items()
            if "cache" in k}


# ---------------------------------------------------------------------------------------------- TRL
def check_trl(wanted: bool | None) -> bool:
    """Whether to run TRL: `wanted` True needs it importable (ValueError naming the install otherwise);
    None runs it when importable and says so when not; False never."""
    if wanted is False:
        return False
    try:
        import datasets  # noqa: F401
        import trl  # noqa: F401
    except ImportError as exc:
        if wanted:
            raise ValueError(f"--trl: TRL is not importable ({exc}); {TRL_HINT}, or pass --no-trl") from exc
        print(f"[e2e] TRL not importable ({exc}): rlbench only; for the side-by-side run {TRL_HINT}", flush=True)
        return False
    return True


def run_trl(w: Workload, model_dir: str, rollouts: int) -> dict:
    """TRL's GRPOTrainer on the workload: `rollouts` optimizer steps of prompts x n samples each."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cuda = w.device == "cuda"
    record: list[dict] = []

    def reading() -> float | None:  # GiB since the last reading, then the counter starts again
        if not cuda:
            return None
        peak = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
        return peak

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    class Timed(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            sync()
            before, t0 = reading(), time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            sync()
            record[-1].update(rollout_s=time.perf_counter() - t0, before_gb=before, rollout_gb=reading(),
                              response_len=float(out["completion_mask"].sum(1).float().mean()))
            return out

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            sync()
            reading()
            record.append({"start": time.perf_counter()})

        def on_step_end(self, args, state, control, **kwargs):
            sync()
            record[-1].update(step_s=time.perf_counter() - record[-1]["start"], train_gb=reading())

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dtype = torch.bfloat16 if w.dtype == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    texts = prompt_texts(w, rollouts)
    assert all(len(ids) == w.prompt_len for ids in tokenizer(texts[:4])["input_ids"])
    args = GRPOConfig(
        output_dir=os.path.join(tempfile.gettempdir(), "rlbench-e2e-trl"), max_steps=rollouts,
        per_device_train_batch_size=w.trl_batch, gradient_accumulation_steps=w.prompts * w.n // w.trl_batch, num_generations=w.n,
        max_completion_length=w.response_len, generation_kwargs={"min_new_tokens": w.response_len},
        temperature=1.0, beta=0.0, learning_rate=w.lr, lr_scheduler_type="constant", warmup_steps=0,
        adam_beta1=0.9, adam_beta2=0.98, weight_decay=0.1, max_grad_norm=1.0, bf16=w.dtype == "bf16",
        gradient_checkpointing=True, use_cpu=not cuda, shuffle_dataset=False, logging_steps=1,
        report_to="none", save_strategy="no", disable_tqdm=True, seed=0, dataloader_num_workers=0,
    )
    reward = lambda completions, **kwargs: [text_reward(c) for c in completions]  # noqa: E731
    reward.__name__ = "text_reward"
    trainer = Timed(model=model, reward_funcs=reward, args=args, processing_class=tokenizer,
                    train_dataset=Dataset.from_list([{"prompt": p} for p in texts]), callbacks=[Clock()])
    build_s = time.perf_counter() - t0
    trainer.train()
    tokens = w.prompts * w.n * w.prompt_len
    steps = []
    for r in record:
        peaks = {"rollout": max(r["before_gb"], r["rollout_gb"]), "train": r["train_gb"]} if cuda else {}
        steps.append({"step_s": r["step_s"], "phases": {"rollout": r["rollout_s"], "train": r["step_s"] - r["rollout_s"]},
                      "peaks_gb": peaks, "peak_gb": max(peaks.values()) if peaks else None,
                      "tokens": tokens + w.prompts * w.n * r["response_len"],
                      "generated_tokens": w.prompts * w.n * r["response_len"], "response_len": r["response_len"]})
    return {"build_s": build_s, "num_params": sum(p.numel() for p in model.parameters()), "steps": steps}


# ---------------------------------------------------------------------------------------------- summary
def summarize(run: dict, peak_flops: float | None) -> dict:
    """First step, steady step (median of the rest), per-phase medians, peaks, tokens/s and MFU."""
    first, rest = run["steps"][0], run["steps"][1:] or run["steps"]
    med = lambda f: statistics.median(f(s) for s in rest)  # noqa: E731
    steady = med(lambda s: s["step_s"])
    phases = {p: med(lambda s, p=p: s["phases"][p]) for p in PHASES if p in first["phases"]}
    tokens, generated = med(lambda s: s["tokens"]), med(lambda s: s["generated_tokens"])
    log_prob_tokens = med(lambda s: s.get("log_prob_tokens", s["tokens"]))  # the tokens the passes ran over
    params = {"rollout": run["num_params"], "log_probs": run["num_params"], "train": run["num_params"],
              "values": run.get("critic_params"), "critic_train": run.get("critic_params")}
    flops = {"rollout": 2 * generated, "log_probs": 2 * log_prob_tokens, "train": 6 * tokens}
    if "values" in phases:  # the critic: a forward over the packs, then forward + backward
        flops |= {"values": 2 * med(lambda s: s["values_tokens"]), "critic_train": 6 * tokens}
    mfu = {p: (flops[p] * params[p] / phases[p] / peak_flops if peak_flops and phases.get(p) else None)
           for p in flops if p in phases}
    mfu["step"] = 6 * tokens * run["num_params"] / steady / peak_flops if peak_flops else None
    peaks = {p: max(s["peaks_gb"][p] for s in run["steps"]) for p in first["peaks_gb"]}
    return {"build_s": run["build_s"], "first_step_s": first["step_s"], "steady_step_s": steady,
            "cold_extra_s": first["step_s"] - steady, "first_step_compile_s": first.get("compile_s"),
            "measured_steps": len(rest), "phases_s": phases,
            "first_step_phases_s": first["phases"], "peak_memory_gb": max(peaks.values()) if peaks else None,
            "phase_peak_memory_gb": peaks, "rollout_tokens_per_s": generated / phases["rollout"],
            "mfu": mfu, "tokens_per_step": tokens, "response_len": med(lambda s: s["response_len"]),
            "steady_compiles": _total(s.get("compiles") for s in rest if s is not first),
            "max_logprob_abs_diff": _max(s.get("logprob_abs_diff") for s in run["steps"]),
            "max_first_mb_kl_vs_rollout": _max(s.get("first_mb_kl_vs_rollout") for s in run["steps"]),
            "num_params": run["num_params"], "critic_params": run.get("critic_params"), "steps": run["steps"],
            "profile": run.get("profile"),
            "start_plan": run.get("start_plan"), "memory_plan": run.get("memory_plan"),
            "compile_caches": run.get("compile_caches")}


def table(rows: dict[str, dict]) -> str:
    """Markdown: one column per system, then rlbench / TRL ratios when TRL ran."""
    names = list(rows)
    ratios = [n for n in names if n != "trl"] if "trl" in names else []
    lines = [("build (load HF dir, init) s", lambda r: r["build_s"]),
             ("first step (cold) s", lambda r: r["first_step_s"]),
             ("steady step (median) s", lambda r: r["steady_step_s"]),
             ("cold start extra (first - steady) s", lambda r: r["cold_extra_s"]),
             ("compile in the first step s", lambda r: r.get("first_step_compile_s"))]
    lines += [(f"{p} s", lambda r, p=p: r["phases_s"].get(p)) for p in PHASES]
    lines += [("rollout tokens/s", lambda r: r["rollout_tokens_per_s"])]
    lines += [(f"MFU {p}", lambda r, p=p: r["mfu"].get(p))
              for p in ("rollout", "log_probs", "values", "train", "critic_train", "step")]
    lines += [("peak memory GiB", lambda r: r["peak_memory_gb"])]
    lines += [(f"peak memory {p} GiB", lambda r, p=p: r["phase_peak_memory_gb"].get(p)) for p in PEAK_KEYS]
    lines += [("graphs compiled after the first step", lambda r: r.get("steady_compiles"))]
    lines += [("max mean \\|rollout - trainer log-prob\\| (per step)", lambda r: r.get("max_logprob_abs_diff")),
              ("max mean \\|rollout - first training forward\\| of the first micro-batch",
               lambda r: r.get("max_first_mb_kl_vs_rollout"))]
    head = ["| | " + " | ".join(names) + "".join(f" | {n} / trl" for n in ratios) + " |",
            "|---" * (1 + len(names) + len(ratios)) + "|"]
    out = []
    for label, get in lines:
        vals = [get(rows[n]) for n in names]
        cells = [_fmt(v, label) for v in vals]
        trl = get(rows["trl"]) if ratios else None
        cells += [f"{get(rows[n]) / trl:.2f}x" if trl and trl > 0 and (get(rows[n]) or 0) > 0 else "—"
                  for n in ratios]
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(head + out)


def _total(values) -> float | None:
    """The sum, None when a value is missing (a system that does not report it)."""
    values = list(values)
    return None if not values or None in values else sum(values)


def _max(values) -> float | None:
    """The maximum, None when no value was reported (TRL, or a metric the run does not log)."""
    values = [v for v in values if v is not None]
    return max(values) if values else None


def _fmt(v, label: str) -> str:
    if v is None:
        return "n/a" if label.startswith("MFU") else "—"
    if label.startswith("MFU"):
        return f"{100 * v:.1f}%"
    if label.startswith("max"):  # mismatch numbers: 0.0 must read as exactly 0
        return "0.0" if v == 0 else f"{v:.2e}"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3f}"


# ---------------------------------------------------------------------------------------------- driver
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rlbench bench e2e", description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(WORKLOADS), default="qwen3-0.6b-shape", help="the workload")
    p.add_argument("--trl", action=argparse.BooleanOptionalAction, default=None,
                   help="run TRL's GRPOTrainer too (default: when importable)")
    p.add_argument("--fast", action="store_true", help="also rlbench with flex_attention + compile forced on and offload off")
    p.add_argument("--steps", type=int, default=3, help="measured steps after the first (cold) one")
    p.add_argument("--prompts", type=int, help="prompts per rollout (workload default)")
    p.add_argument("--n", type=int, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, help="prompt tokens")
    p.add_argument("--response-len", type=int, help="new tokens per sample")
    p.add_argument("--vocab-size", type=int, help="model and tokenizer vocabulary (default 151,936)")
    p.add_argument("--trl-micro-batch", type=int, help="TRL per_device_train_batch_size (default: n)")
    p.add_argument("--max-tokens-per-gpu", type=int, help="rlbench's micro-batch token cap (default 16384)")
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                   help="rlbench's activation checkpointing (default: the start-up memory plan decides)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: min(2, cores))")
    p.add_argument("--model-dir", default=None, help="reuse or write the HF directory here (default: a temp dir)")
    p.add_argument("--out", default=None, help="JSON file (default benchmarks/results/e2e_<date>.json)")
    p.add_argument("--true-on-policy", action="store_true",
                   help="also rlbench with the defaults and true_on_policy_mode (the mode's cost beside the defaults)")
    p.add_argument("--ppo", action="store_true",
                   help="also rlbench with advantage_estimator='gae' (PPO with a colocated critic) beside GRPO")
    p.add_argument("--profile", action="store_true",
                   help="after the measured steps, one more rollout and its train phase under torch.profiler per "
                        "rlbench system: the top kernels, printed and in the JSON")
    p.add_argument("--child", choices=[*VARIANTS, "trl"], help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps {args.steps}: measure at least 1 step after the cold one")
    return args


def workload(args: argparse.Namespace) -> Workload:
    fields = {k: getattr(args, k) for k in ("prompts", "n", "prompt_len", "response_len", "vocab_size", "trl_micro_batch",
                                            "max_tokens_per_gpu", "gradient_checkpointing")}
    return dataclasses.replace(WORKLOADS[args.preset], **{k: v for k, v in fields.items() if v is not None})


def child(args: argparse.Namespace) -> None:
    """One system in this process; its raw per-step record goes to `--result`."""
    import torch

    torch.set_num_threads(args.threads or min(2, os.cpu_count() or 1))
    w, rollouts = workload(args), args.steps + 1
    if args.child == "trl":
        run = run_trl(w, args.model_dir, rollouts)
    else:
        run = run_rlbench(w, args.model_dir, rollouts, VARIANTS[args.child], profile=args.profile)
    with open(args.result, "w") as f:
        json.dump(run, f)


def run_system(system: str, argv: list[str], model_dir: str, workdir: str) -> dict:
    """Run `system` in a fresh Python process (a real cold start); returns its raw record."""
    result = os.path.join(workdir, f"{system}.json")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--child", system, "--model-dir", model_dir,
           "--result", result]
    print(f"[e2e] {system} ...", flush=True)
    subprocess.run(cmd, env=env, check=True)
    with open(result) as f:
        return json.load(f)


def device_name(device: str) -> str:
    import torch

    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child:
        child(args)
        return 0
    import torch
    import transformers

    from rlbench.compile_cache import use_compile_cache
    from rlbench.trainer import PEAK_FLOPS

    # Before anything here touches CUDA: the systems' processes inherit this environment, and a variable torch
    # set to its default in this process (inductor does, on its first use) would move their caches elsewhere.
    use_compile_cache()
    w = workload(args)
    systems = (["rlbench"] + ["rlbench-fast"] * args.fast + ["rlbench-top"] * args.true_on_policy
               + ["rlbench-ppo"] * args.ppo + ["trl"] * check_trl(args.trl))
    machine = device_name(w.device)
    peak_flops = next((v for k, v in PEAK_FLOPS.items() if k in machine), None) if w.device == "cuda" else None
    load = os.getloadavg()
    date = datetime.date.today().isoformat()
    default_out = f"e2e_{date}.json" if args.preset == "qwen3-0.6b-shape" else f"e2e_{args.preset}_{date}.json"
    out_path = args.out or os.path.join(REPO, "benchmarks", "results", default_out)
    report = {"date": date, "machine": machine, "load_avg_1m_before": load[0], "torch": torch.__version__,
              "transformers": transformers.__version__, "trl": _version("trl") if "trl" in systems else None,
              "command": "rlbench bench e2e " + " ".join(argv), "workload": dataclasses.asdict(w),
              "peak_flops": peak_flops, "rows": {}}
    with tempfile.TemporaryDirectory(prefix="rlbench-e2e-") as workdir:
        model_dir = write_model_dir(w, args.model_dir or os.path.join(workdir, "model"))
        for system in systems:
            report["rows"][system] = summarize(run_system(system, argv, model_dir, workdir), peak_flops)
            _write(report, out_path)  # after every system: a later failure keeps the earlier rows
    report["load_avg_1m_after"] = os.getloadavg()[0]
    _write(report, out_path)
    print(f"\n{args.preset} on {machine}: {w.prompts} prompts x {w.n} samples, {w.prompt_len} + {w.response_len} "
          f"tokens, {w.dtype}; steady = median of {args.steps} steps after the first\n")
    for system, row in report["rows"].items():
        for line in row.get("start_plan") or ():
            print(f"[e2e] {system} {line}")
        if row.get("memory_plan"):
            print(f"[e2e] {system} memory plan: {row['memory_plan']}")
        if row.get("compile_caches"):
            print(f"[e2e] {system} compile caches: {row['compile_caches']}")
        if row.get("profile"):
            print(f"\n[e2e] {system}: {row['profile']}")
    print(table(report["rows"]))
    print(f"\n[e2e] wrote {out_path}", flush=True)
    return 0


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def _write(report: dict, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
