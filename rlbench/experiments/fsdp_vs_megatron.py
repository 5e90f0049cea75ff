"""FSDP vs Megatron: what each training backend supports (probed), how one run converges on both, the CP table.

    rows = feature_table()                      # {feature, FSDP, Megatron, evidence}: each cell a check's outcome
    rows = feature_table(live=True)             # + rows measured on both backends built side by side (tiny, CPU)
    result = convergence(steps=4)               # one SFT warm start, task and seeds; each backend in turn
    runs = stored_results()                     # benchmarks/results/fsdp_vs_megatron_*: {name: result}
    rows = cp_oom_table()                       # benchmarks/results/cp_oom_*: one row per sweep cell

    rlbench experiment fsdp-vs-megatron --device cuda --sft-steps 800 --steps 8 --lr 1e-5 \
        --out benchmarks/results/fsdp_vs_megatron_<date>_sft800.json      # docs/megatron.md, "to reproduce"

Nothing in the feature table is typed in as a verdict. A setting is "supported" when the backend's own config
and constructor accept it (`TrainConfig`, `MegatronConfig`, `FSDPBackend(...)`, `MegatronBackend(...)`,
`RunConfig(train_backend=...)`); a refusal's `ValueError` message is the reason shown. Fields are read from the
dataclasses, methods from the classes, optional packages (TransformerEngine) from the import system. The text
around a "yes" names what the probe tried.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import gc
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rlbench.configs.backend import (
    ATTN_IMPLEMENTATIONS,
    CP_ATTENTIONS,
    PARAM_DTYPES,
    FSDPOptions,
    TrainConfig,
)
from rlbench.configs.megatron import CORE_ATTENTIONS, RECOMPUTE_GRANULARITIES, MegatronConfig
from rlbench.configs.run import TRAIN_BACKENDS

BACKENDS = TRAIN_BACKENDS
"""The backends compared (`RunConfig.train_backend` values)."""
FEATURE_COLUMNS = ("feature", "FSDP", "Megatron", "evidence")
"""The keys of a `feature_table` row, in order."""
CURVE_KEYS = ("rollout/raw_reward", "train/kl_loss", "train/train_rollout_logprob_abs_diff", "train/grad_norm")
"""The per-step curves overlaid: reward, KL to the reference (the loss term), |train − rollout| log-prob per
token, the global grad norm."""
STEP_KEYS = CURVE_KEYS + (
    "train/loss", "train/pg_loss", "train/ppo_kl", "train/ppo_kl_first_mb", "train/skipped", "rollout/id",
    "rollout/response_len/mean", "perf/step_time", "perf/rollout_time", "perf/log_probs_time", "perf/train_time",
    "perf/update_weights_time", "perf/peak_memory_gb",
)
"""Per-step metrics a convergence record keeps (those the step reported)."""
RESULTS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
"""Where the stored experiment outputs are (`cp_oom_*/`, `fsdp_vs_megatron_*`)."""
WHAT = "the same SFT warm start, task and seeds on the FSDP and the megatron backend"


# ============================================================================================== probes
def _try(build: Callable[[], Any]) -> tuple[bool, str]:
    """`(True, "")` when `build()` returns, `(False, the first line of its refusal)` when it raises a user error."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            build()
    except (ValueError, ImportError, TypeError) as exc:
        return False, (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return True, ""


def package_version(dist: str) -> str | None:
    """The installed version of the distribution `dist`, or None."""
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        return importlib.metadata.version(dist)
    return None


def fsdp_accepts(**fsdp: Any) -> tuple[bool, str]:
    """Does the FSDP backend take these `TrainConfig` settings (validation + `FSDPBackend(cfg)`)? CPU fp32 unless
    given."""
    from rlbench.backends.fsdp.actor import FSDPBackend

    return _try(lambda: FSDPBackend(TrainConfig(**({"device": "cpu", "param_dtype": "fp32"} | fsdp))))


def megatron_accepts(fsdp: Mapping[str, Any] | None = None, **megatron: Any) -> tuple[bool, str]:
    """Does the megatron backend take these settings (`MegatronConfig(**megatron)` and
    `MegatronBackend(TrainConfig(**fsdp), ...)`, whose constructor refuses the FSDP-only settings)?"""
    from rlbench.backends.megatron.backend import MegatronBackend

    fsdp = {"device": "cpu", "param_dtype": "fp32"} | dict(fsdp or {})
    return _try(lambda: MegatronBackend(TrainConfig(**fsdp), MegatronConfig(**megatron)))


def run_accepts(train_backend: str, **changes: Any) -> tuple[bool, str]:
    """Does `RunConfig` (the CPU test preset, `train_backend`, `changes`) validate?"""
    from rlbench import presets

    cfg = presets.cpu_test(model="tiny", workdir=tempfile.gettempdir())  # nothing is written
    return _try(lambda: cfg.replace(train_backend=train_backend, **changes))


def _cell(ok: bool, why: str = "", yes: str = "yes") -> str:
    return yes if ok else f"no ({why})" if why else "no"


def _field(cls: type, name: str) -> tuple[bool, str]:
    """Whether the dataclass `cls` has the field `name`; the reason names it."""
    ok = name in {f.name for f in dataclasses.fields(cls)}
    return ok, "" if ok else f"{cls.__name__} has no {name} field"


def _accepted(probe: Callable[[Any], tuple[bool, str]], options: Iterable[Any]) -> tuple[list, dict]:
    """`(options probe accepted, {refused option: reason})`."""
    answers = {opt: probe(opt) for opt in options}
    return [o for o, (ok, _) in answers.items() if ok], {o: why for o, (ok, why) in answers.items() if not ok}


def _by_device(yes: str, **megatron: Any) -> str:
    """The megatron backend's answer to `megatron` on CUDA (bf16) and on the CPU (fp32), as one cell."""
    gpu, gpu_why = megatron_accepts({"device": "cuda", "param_dtype": "bf16"}, **megatron)
    cpu, cpu_why = megatron_accepts(**megatron)
    return yes if gpu and cpu else f"{_cell(gpu, gpu_why, yes)} on CUDA; CPU: {_cell(cpu, cpu_why)}"


# ============================================================================================== feature table
def feature_table(*, live: bool = False, device: str = "cpu") -> list[dict[str, str]]:
    """The FSDP / Megatron comparison: one row per feature, each cell the outcome of a check (module docstring).

    Args:
        live: also build both backends (the `tiny` model) and measure what they do (`live_checks`, ~5 s).
        device: where the live checks run: "cpu" (fp32) or "cuda" (bf16). megatron in a process runs on one device
            (`backends/megatron/cpu.py`): on a GPU machine pass "cuda".
    """
    from rlbench.backends.fsdp.actor import FSDPBackend
    from rlbench.backends.megatron.backend import MegatronBackend

    rows: list[dict[str, str]] = []

    def row(feature: str, fsdp: str, megatron: str, evidence: str) -> None:
        rows.append(dict(zip(FEATURE_COLUMNS, (feature, fsdp, megatron, evidence))))

    te = importlib.util.find_spec("transformer_engine") is not None
    mcore = package_version("megatron-core")
    row("installed", f"torch {package_version('torch')}",
        f"megatron-core {mcore}" if mcore else "no (pip install 'rlbench[megatron]')",
        f"importlib.metadata; transformer_engine importable: {te}")

    # --- parallelism
    for feature, name, yes, probe in (
            ("tensor parallel (TP)", "tensor_model_parallel_size", "yes (TP=2 accepted)",
             dict(tensor_model_parallel_size=2)),
            ("sequence parallel (SP)", "sequence_parallel", "yes (with TP=2)",
             dict(tensor_model_parallel_size=2, sequence_parallel=True))):
        row(feature, _cell(*_field(TrainConfig, name)), _cell(*megatron_accepts(**probe), yes),
            f"TrainConfig fields; MegatronBackend(TrainConfig(), MegatronConfig(**{probe}))")
    sp1 = _try(lambda: MegatronConfig(sequence_parallel=True))
    rows[-1]["Megatron"] += "" if sp1[0] else f"; TP=1: no ({sp1[1]})"
    row("pipeline parallel (PP)", _cell(*_field(TrainConfig, "pipeline_model_parallel_size")),
        _by_device("yes (1F1B)", pipeline_model_parallel_size=2),
        "MegatronConfig(pipeline_model_parallel_size=2) with TrainConfig(device='cuda', bf16) and device='cpu'")
    kernels, _ = _accepted(lambda k: _try(lambda: TrainConfig(device="cuda", cp_size=2, fsdp=FSDPOptions(cp_attention=k))),
                           CP_ATTENTIONS)
    m_cp, m_cp_why = megatron_accepts({"cp_size": 2})
    row("context parallel (CP)", _cell(*fsdp_accepts(cp_size=2), f"yes (kernels: {', '.join(kernels)})"),
        _cell(m_cp, m_cp_why) + ("" if te else "; transformer_engine not importable"),
        "FSDPBackend(TrainConfig(cp_size=2)), TrainConfig(fsdp=FSDPOptions(cp_attention=each)); MegatronBackend(TrainConfig(cp_size=2))")
    zero3 = _field(TrainConfig, "reshard_after_forward")
    row("parameter + gradient sharding (ZeRO-3)", _cell(*zero3, "yes (fully_shard per block)"),
        _cell(*_field(MegatronConfig, "use_megatron_fsdp")), "config fields (megatron-core's own FSDP is not wired)")
    row("optimizer-state sharding (ZeRO-1)", _cell(*zero3, "yes (sharded with the params)"),
        _by_device("yes (use_distributed_optimizer)", use_distributed_optimizer=True),
        "MegatronBackend(TrainConfig(device=cuda / cpu), MegatronConfig(use_distributed_optimizer=True))")

    # --- memory
    gran, gran_no = _accepted(lambda g: megatron_accepts(recompute_granularity=g),
                              [g for g in RECOMPUTE_GRANULARITIES if g])
    m_gc, m_gc_why = megatron_accepts({"gradient_checkpointing": True})
    row("activation recompute",
        _cell(*fsdp_accepts(gradient_checkpointing=True, checkpoint_every=2), "yes (gradient_checkpointing, "
              "every k-th layer)"),
        (f"yes (recompute_granularity: {', '.join(gran)})" if gran else f"no ({gran_no})")
        + ("" if m_gc else f"; gradient_checkpointing: no ({m_gc_why})"),
        "FSDPBackend(gradient_checkpointing=True, checkpoint_every=2); MegatronConfig(recompute_granularity=each); "
        "MegatronBackend(TrainConfig(fsdp=FSDPOptions(gradient_checkpointing=True)))")
    row("CPU offload of the training state (cpu_offload)", _cell(*fsdp_accepts(cpu_offload=True)),
        _cell(*megatron_accepts({"cpu_offload": True})), "both constructors with TrainConfig(fsdp=FSDPOptions(cpu_offload=True))")
    sw = [_cell(all(callable(getattr(cls, m, None)) for m in ("sleep", "wake_up")), "no sleep()/wake_up()")
          for cls in (FSDPBackend, MegatronBackend)]
    row("sleep / wake_up (colocated: state parked in host memory)", *sw, "methods of both classes")

    # --- precision, kernels
    for dev in ("cpu", "cuda"):
        f_dt, _ = _accepted(lambda d, dev=dev: fsdp_accepts(device=dev, param_dtype=d), PARAM_DTYPES)
        m_dt, m_no = _accepted(lambda d, dev=dev: megatron_accepts({"device": dev, "param_dtype": d}), PARAM_DTYPES)
        why = f"; not {', '.join(m_no)} ({next(iter(m_no.values()))})" if m_no else ""
        row(f"param dtypes on {dev.upper()}", ", ".join(f_dt), ", ".join(m_dt) + why,
            f"TrainConfig(device={dev!r}, param_dtype=each) through both constructors")
    m_fp8, m_fp8_why = _field(MegatronConfig, "fp8")
    fp8_why = [m_fp8_why] if not m_fp8 else []
    if not te:
        fp8_why.append("transformer_engine not importable")
    row("FP8 training", _cell(*_field(TrainConfig, "fp8")), _cell(not fp8_why, "; ".join(fp8_why)),
        "config fields; import system (megatron-core's FP8 runs in TransformerEngine layers)")
    row("batch-invariant numerics (true on-policy mode)", _cell(*fsdp_accepts(batch_invariant=True, compile=False)),
        _cell(*run_accepts("megatron", true_on_policy_mode=True)),
        "FSDPBackend(TrainConfig(batch_invariant=True)); RunConfig(train_backend='megatron', true_on_policy_mode=True)")
    attn = {dev: (_accepted(lambda a, dev=dev: _try(lambda: TrainConfig(device=dev, fsdp=FSDPOptions(attn_implementation=a))),
                            ATTN_IMPLEMENTATIONS)[0],
                  _accepted(lambda a, dev=dev: _try(lambda: MegatronConfig(attention=a).core_attention(dev)),
                            CORE_ATTENTIONS)[0]) for dev in ("cuda", "cpu")}
    row("attention kernels (packed, no padding)",
        *("; ".join(f"{dev.upper()}: {', '.join(attn[dev][i])}" for dev in attn) for i in (0, 1)),
        "TrainConfig(fsdp=FSDPOptions(attn_implementation=each)); MegatronConfig(attention=each).core_attention(device)")

    # --- model, weights, checkpoints, the loop
    ref = [_cell(callable(getattr(cls, "update_ref", None)), "no update_ref()") for cls in (FSDPBackend, MegatronBackend)]
    row("reference model (+ update_ref)", *ref, "TrainConfig.ref_model (shared); each class's update_ref()")
    fmts, _ = _accepted(lambda f: _try(lambda: TrainConfig(fsdp=FSDPOptions(checkpoint_format=f))), ("sharded", "full", "torch_dist"))
    row("checkpoint formats", f"{', '.join(fmts)} (TrainConfig.checkpoint_format)",
        "per-rank model + optimizer state (rank<N>.pt; checkpoint_format has no effect)",
        "TrainConfig(fsdp=FSDPOptions(checkpoint_format=each)); MegatronBackend.save (live rows: the files written)")
    hf = [_cell(all(callable(getattr(cls, m, None)) for m in ("export_hf", "named_weights_for_sync")),
                "no export_hf / named_weights_for_sync", yes)
          for cls, yes in ((FSDPBackend, "yes (the HF model itself)"),
                           (MegatronBackend, "yes (converted: fused QKV / gate-up, TP / PP split)"))]
    row("HF weights in / out (load an HF dir, export_hf, sync HF-named buckets)", *hf, "methods of both classes")
    row("rlbench train / Trainer (one process)", *(_cell(*run_accepts(b)) for b in BACKENDS),
        "RunConfig(train_backend=each) on the CPU test preset")
    row("TP / PP through the Trainer (one process)", "— (no TP / PP)",
        _cell(*run_accepts("megatron", megatron=MegatronConfig(tensor_model_parallel_size=2))),
        "RunConfig(train_backend='megatron', megatron=MegatronConfig(tensor_model_parallel_size=2))")
    from rlbench.configs.cluster import ClusterConfig

    row("Ray cluster (several trainer ranks)",
        *(_cell(*run_accepts(b, cluster=ClusterConfig(backend="ray"))) for b in BACKENDS),
        "RunConfig(train_backend=each, cluster=ClusterConfig(backend='ray'))")
    if live:
        rows.extend(live_checks(device))
    return rows


def live_checks(device: str = "cpu", model: str = "tiny") -> list[dict[str, str]]:
    """Rows measured on both backends built side by side (`model`; CPU fp32 or CUDA bf16; temperature 0.7):
    log-probs of one packed micro-batch, one training step on it, checkpoint save -> train -> load, sleep -> wake_up.

    A failure is the measurement: its cell says "no (the error)"."""
    import torch

    from rlbench.backends.fsdp.actor import FSDPBackend
    from rlbench.backends.megatron.backend import MegatronBackend
    from rlbench.packing.pack import pack_samples
    from rlbench.types import Sample

    g = torch.Generator().manual_seed(0)
    samples = [Sample(tokens=torch.randint(0, 100, (n,), generator=g).tolist(), response_length=r, advantage=1.0)
               for n, r in ((12, 5), (20, 9), (9, 4))]
    pack = pack_samples(samples, pad_multiple=8)
    inputs = [{"w": torch.full((pack.response_index.numel(),), 0.1)}]

    def loss_fn(logp, ent, inp):  # [R] log-probs of the pack's response tokens
        return -(logp * inp["w"]).sum(), {}

    def logp(b):
        return b.compute_log_prob([pack])[0].log_probs

    dtype, tol = ("fp32", 1e-5) if device == "cpu" else ("bf16", 2e-2)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfgs = {n: TrainConfig(model=model, device=device, param_dtype=dtype, checkpoint_dir=os.path.join(tmp, n), fsdp=FSDPOptions(compile=False)) for n in BACKENDS}
        mb = MegatronBackend(cfgs["megatron"], MegatronConfig(), temperature=0.7)
        mb.init()
        fb = FSDPBackend(cfgs["fsdp"], env=mb.env, temperature=0.7)
        fb.init()
        backends = {"fsdp": fb, "megatron": mb}
        out = {n: b.compute_log_prob([pack], with_entropy=True)[0] for n, b in backends.items()}
        d_lp = float((out["fsdp"].log_probs - out["megatron"].log_probs).abs().max())
        d_ent = float((out["fsdp"].entropy - out["megatron"].entropy).abs().max())
        ok = _cell(d_lp <= tol, "see evidence")
        rows.append({"feature": "log-probs of one packed micro-batch (measured)", "FSDP": ok, "Megatron": ok,
                     "evidence": f"max |Δ log-prob| {d_lp:.1e}, |Δ entropy| {d_ent:.1e} (tolerance {tol:g}); 3 "
                                 f"sequences in one pack ({pack.num_tokens} tokens), {model}, {device} {dtype}, T 0.7"})
        step = {n: b.train([pack], inputs, loss_fn=loss_fn) for n, b in backends.items()}
        after = {n: logp(b) for n, b in backends.items()}
        ok = {n: _cell(m["train/skipped"] == 0, "step skipped") for n, m in step.items()}
        rows.append({"feature": "one training step (measured)", "FSDP": ok["fsdp"], "Megatron": ok["megatron"],
                     "evidence": f"|Δ loss| {abs(step['fsdp']['train/loss'] - step['megatron']['train/loss']):.1e}, "
                                 f"|Δ grad norm| {abs(step['fsdp']['train/grad_norm'] - step['megatron']['train/grad_norm']):.1e}, "
                                 f"max |Δ log-prob| after it {float((after['fsdp'] - after['megatron']).abs().max()):.1e}"})

        def round_trip(b, ref):
            path = b.save()
            files = sorted(os.listdir(path))
            b.train([pack], inputs, loss_fn=loss_fn)  # move away, then back
            b.load()
            return torch.equal(logp(b), ref), f"yes ({', '.join(files)})"

        def sleep_wake(b, ref):
            moved = b.sleep()["memory/sleep_moved_bytes"]
            b.wake_up()
            return torch.equal(logp(b), ref), f"yes ({moved / 2**20:.2f} MiB parked)"

        for feature, check, evidence in (
                ("checkpoint save -> train -> load (measured)", round_trip,
                 "save(), one more step, load(): log-probs bit-identical to those at the save"),
                ("sleep -> wake_up after the load (measured)", sleep_wake,
                 "sleep(), wake_up() on the loaded backend: log-probs bit-identical")):
            cells = {n: _measure(lambda c=check, b=b, ref=after[n]: c(b, ref)) for n, b in backends.items()}
            rows.append({"feature": feature, "FSDP": cells["fsdp"], "Megatron": cells["megatron"],
                         "evidence": evidence})
        del fb, mb, backends
        gc.collect()
    return rows


def _measure(check: Callable[[], tuple[bool, str]]) -> str:
    """A measured cell: the check's "yes ..." text, "no (differs)" when it returned False, or "no (the error)"."""
    try:
        ok, yes = check()
    except Exception as exc:  # noqa: BLE001  (the failure is the measurement, shown in its cell)
        return f"no ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    return _cell(ok, "log-probs differ", yes)


# ============================================================================================== convergence
SMOKE_SFT = dict(preset="tiny", task="arithmetic", task_kwargs={"level": 1}, batch_size=32, lr=3e-3,
                 warmup_steps=10, num_eval=16, target_pass_at_1=None)
"""The CPU warm start: the `tiny` model on 1-digit addition (200 steps: pass@1 ~0.4 in ~10 s on one core)."""


def warm_start(device: str, out: str, sft_steps: int | None = None, preset: str = "qwen3-0.6b-shape") -> str:
    """The SFT warm start in `out` (reused when a finished one is there): CPU `SMOKE_SFT` (`sft_steps`, default
    200), CUDA `presets.gpu_sft(preset)` (default 150 steps, what `rlbench bench` builds). Returns the HF dir."""
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    from rlbench import presets
    from rlbench.sft import SFTConfig, run_sft

    if device == "cpu":
        steps = sft_steps or 200
        cfg = SFTConfig(**SMOKE_SFT, out=out, max_steps=steps, eval_every=steps)
    else:
        cfg = presets.gpu_sft(preset, out, steps=sft_steps or 150)
    with contextlib.redirect_stdout(sys.stderr):
        run_sft(cfg)
    return out


def run_config(model: str, workdir: str, *, device: str = "cpu", steps: int = 4, seed: int = 0,
               kl_loss_coef: float = 0.01, lr: float | None = None, gpus: int = 1, tp: int | None = None, pp: int = 1,
               sequence_parallel: bool = False):
    """The comparison's run: GRPO on arithmetic from the warm start `model`, a KL loss to it (reference model =
    `model`), no eval. CPU: `presets.cpu_test` (level 1, 4 prompts x 8 samples, gbs 16: 2 optimizer steps per
    rollout, fp32); CUDA: `presets.qwen3_0p6b_gpu` (bf16). `lr` None: the preset's.

    `gpus` > 1: a Ray cluster of that many colocated trainer ranks (one engine each): FSDP runs DP = gpus,
    megatron TP = `tp` (None: gpus / pp) x PP = `pp` (with `sequence_parallel`), DP = the rest."""
    from rlbench import presets
    from rlbench.configs import EvalConfig
    from rlbench.configs.cluster import ClusterConfig
    from rlbench.configs.megatron import MegatronConfig

    if device == "cpu":
        cfg = presets.cpu_test(model=model, workdir=workdir, level=1, seed=seed, n_eval=16)
        cfg = cfg.replace(rollout=dataclasses.replace(cfg.rollout, rollout_batch_size=4),
                          batch=dataclasses.replace(cfg.batch, global_batch_size=16))
    else:
        cfg = presets.qwen3_0p6b_gpu(model=model, workdir=workdir)
        cfg = cfg.replace(rollout=dataclasses.replace(cfg.rollout, seed=seed))
    b = cfg.backend
    if gpus > 1:
        tp = tp or max(1, gpus // pp)
        cfg = cfg.replace(cluster=ClusterConfig(backend="ray", actor_num_gpus_per_node=gpus, colocate=True),
                          megatron=MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                                  sequence_parallel=sequence_parallel))
    return cfg.replace(
        eval=EvalConfig(),
        batch=dataclasses.replace(cfg.batch, num_rollout=steps),
        backend=dataclasses.replace(b, ref_model=model, optim=dataclasses.replace(b.optim, lr=lr or b.optim.lr)),
        loss=dataclasses.replace(cfg.loss, use_kl_loss=kl_loss_coef > 0, kl_loss_coef=kl_loss_coef,
                                 kl_loss_type="low_var_kl"),
        logging=dataclasses.replace(cfg.logging, console=False, jsonl_path=None),
    )


def build_trainers(cfg, backends: Sequence[str] = BACKENDS) -> dict[str, Any]:
    """`{backend: trainer of cfg with train_backend=backend}` (a `RayTrainer` when `cfg.cluster` is Ray): the same
    model, task and seeds."""
    from rlbench.orchestration import build_trainer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {name: build_trainer(cfg.replace(train_backend=name)) for name in backends}


def step_record(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The `STEP_KEYS` of one step's metrics (those reported)."""
    return {k: float(metrics[k]) for k in STEP_KEYS if k in metrics}


def summarize(steps: Sequence[Mapping[str, float]]) -> dict[str, Any]:
    """Median step time after the first (warm-up) step, the first step's time, peak memory (CUDA), mean reward."""
    times = [s["perf/step_time"] for s in steps if "perf/step_time" in s]
    peaks = [s["perf/peak_memory_gb"] for s in steps if "perf/peak_memory_gb" in s]
    rewards = [s["rollout/raw_reward"] for s in steps if "rollout/raw_reward" in s]
    return {"steps": len(steps),
            "step_time_s_median": statistics.median(times[1:] or times) if times else None,
            "first_step_time_s": times[0] if times else None,
            "peak_memory_gb": max(peaks) if peaks else None,
            "reward_mean": statistics.fmean(rewards) if rewards else None}


def collect(trainers: Mapping[str, Any], meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The result of already-stepped trainers (e.g. a `TrainerGroup` run in the notebook), as `convergence`
    returns it."""
    runs = {}
    for name, t in trainers.items():
        steps = [step_record(m) for m in t.history]
        runs[name] = {"steps": steps, "summary": summarize(steps)}
    return {"what": WHAT, **dict(meta or {}), "backends": runs, "checks": checks(runs)}


def checks(runs: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Step-0 agreement of the first two backends: the same rollout (reward), and |a − b| of the loss, the grad
    norm and the train–rollout log-prob diff. Empty with fewer than two runs."""
    if len(runs) < 2 or not all(run["steps"] for run in runs.values()):
        return {}
    a, b = (run["steps"][0] for run in list(runs.values())[:2])
    out = {"step0_reward_equal": a.get("rollout/raw_reward") == b.get("rollout/raw_reward")}
    for name, key in (("loss", "train/loss"), ("grad_norm", "train/grad_norm"),
                      ("logprob_diff", "train/train_rollout_logprob_abs_diff")):
        out[f"step0_{name}_abs_diff"] = abs(a[key] - b[key]) if key in a and key in b else None
    return out


def convergence(steps: int = 4, backends: Sequence[str] = BACKENDS, device: str = "cpu", *, model: str | None = None,
                workdir: str | None = None, seed: int = 0, sft_steps: int | None = None, kl_loss_coef: float = 0.01,
                lr: float | None = None, on_step: Callable[[str, dict], None] | None = None,
                **layout: Any) -> dict[str, Any]:
    """The same GRPO run (`run_config`) on each backend in turn (each trainer freed before the next is built).

    Args:
        steps: RL steps per backend.
        device: "cpu" (fp32, the `tiny` warm start) or "cuda" (bf16, the 0.6B shape).
        model: the SFT warm start (an HF directory); None: `warm_start(device, workdir/sft, sft_steps)`.
        on_step: called with `(backend, step metrics)` after every step.
        layout: `gpus`, `tp`, `pp`, `sequence_parallel` of `run_config` (several trainer ranks on Ray).

    Returns:
        `{"what", "provenance", "config", "warm_start", "backends": {name: {"steps": [per-step STEP_KEYS],
        "summary": {...}}}, "checks"}` (JSON-serialisable).
    """
    import torch

    workdir = workdir or tempfile.mkdtemp(prefix="fsdp-vs-megatron-")
    t0 = time.perf_counter()
    model = model or warm_start(device, os.path.join(workdir, "sft"), sft_steps)
    sft_s = time.perf_counter() - t0
    cfg = run_config(model, workdir, device=device, steps=steps, seed=seed, kl_loss_coef=kl_loss_coef, lr=lr,
                     **layout)
    runs = {}
    for name in backends:
        # on CUDA: what the previous backend left allocated (its peak counts in this one's peak memory)
        left = torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else None
        t1 = time.perf_counter()
        trainer = build_trainers(cfg, [name])[name]
        build_s = time.perf_counter() - t1
        for _ in range(steps):
            m = trainer.step()
            if on_step is not None:
                on_step(name, m)
        runs[name] = collect({name: trainer})["backends"][name]
        runs[name]["summary"] |= {"build_s": build_s, "allocated_before_build_gb": left}
        if hasattr(trainer, "close"):
            trainer.close()  # a RayTrainer's actors hold the GPUs
        del trainer
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    sft_file = os.path.join(model, "sft_metrics.json")
    sft = json.loads(Path(sft_file).read_text()) if os.path.isfile(sft_file) else {}
    return {
        "what": WHAT, "provenance": provenance(),
        "config": {"device": device, "model": model, "steps": steps, "seed": seed, "kl_loss_coef": kl_loss_coef,
                   "rollout_batch_size": cfg.rollout.rollout_batch_size,
                   "n_samples_per_prompt": cfg.rollout.n_samples_per_prompt,
                   "global_batch_size": cfg.batch.global_batch_size, "param_dtype": cfg.backend.param_dtype,
                   "lr": cfg.backend.optim.lr, "sft_s": sft_s, "cluster": cfg.cluster.backend,
                   "trainer_gpus": layout.get("gpus", 1), "megatron": dataclasses.asdict(cfg.megatron)},
        "warm_start": {k: v for k, v in sft.items() if k != "history"},
        "backends": runs, "checks": checks(runs),
    }


def provenance() -> dict[str, Any]:
    """Date, command, machine and versions of this process."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"date": time.strftime("%Y-%m-%d"), "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
            "machine": gpu or f"{platform.machine()} CPU, {os.cpu_count()} cores", "torch": torch.__version__,
            "megatron_core": package_version("megatron-core"), "python": platform.python_version()}


# ============================================================================================== stored results
def load_result(path: str | Path) -> dict[str, Any]:
    """A stored comparison as `convergence` returns it: a `convergence` JSON, or a directory of per-backend
    metric files `<backend>.jsonl` (what `rlbench bench --train-backend B` writes; summaries recomputed)."""
    path = Path(path)
    if path.is_file():
        return json.loads(path.read_text())
    runs = {}
    for name in BACKENDS:
        if (path / f"{name}.jsonl").is_file():
            steps = [step_record(json.loads(line)) for line in (path / f"{name}.jsonl").read_text().splitlines()
                     if line.strip()]
            runs[name] = {"steps": steps, "summary": summarize(steps)}
    if not runs:
        raise ValueError(f"{path}: neither a result JSON nor a directory with {' / '.join(BACKENDS)}.jsonl")
    return {"what": WHAT, "source": path.name, "backends": runs, "checks": checks(runs)}


def stored_results(root: str | Path = RESULTS_DIR) -> dict[str, dict[str, Any]]:
    """Every stored `fsdp_vs_megatron_*` (JSON or directory) under `root`, by name without the prefix (and
    without ".json" unless a directory has that name), in name order."""
    prefix, out = "fsdp_vs_megatron_", {}
    for p in sorted(p for p in Path(root).glob(f"{prefix}*") if p.is_dir() or p.suffix == ".json"):
        name = p.name[len(prefix):]
        out[name if name.removesuffix(".json") in out else name.removesuffix(".json")] = load_result(p)
    return out


def curve_runs(results: Mapping[str, Mapping[str, Any]]) -> dict[str, list[dict]]:
    """`{"<backend> <name>": per-step records}` of several results, for `rlbench.viz.on_policy.metric_curves`."""
    return {f"{b} {name}": run["steps"] for name, r in results.items() for b, run in r["backends"].items()}


COST_COLUMNS = (("result", "result"), ("backend", "backend"), ("steps", "steps"),
                ("first_step_time_s", "first step s"), ("step_time_s_median", "step s (median, after the first)"),
                ("peak_memory_gb", "peak GiB"), ("reward_mean", "mean reward"))
"""`(key, header)` of `cost_rows`, for `rlbench.viz.on_policy.table_html`."""


def cost_rows(results: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per (result, backend): its summary (step time, peak memory, mean reward)."""
    return [{"result": name, "backend": b, **run["summary"]}
            for name, r in results.items() for b, run in r["backends"].items()]


# ============================================================================================== CP-OOM table
CP_OOM_COLUMNS = (("sweep", "sweep"), ("preset", "preset"), ("ac", "AC"), ("layout", "layout"),
                  ("source", "source"), ("longest", "longest that trains"), ("first_oom", "first OOM"),
                  ("extrapolated", "extrapolated"), ("peak_gib", "peak GiB at longest"),
                  ("tokens_per_s_per_gpu", "tokens/s/GPU at longest"))
"""`(key, header)` of `cp_oom_table` rows."""


def _k(n: int | None) -> str:
    return "" if n is None else f"{n // 1024}k" if n % 1024 == 0 and n else str(n)


def cp_oom_table(root: str | Path = RESULTS_DIR) -> list[dict[str, Any]]:
    """The CP out-of-memory table from the CP issue's stored sweeps (`cp_oom_*/cp_oom_cells.csv`, written by
    `rlbench experiment cp-oom`): one row per (sweep, AC, FSDP cp size), and one per CP size for Megatron.

    `source` is "measured" (a real run of that layout: one GPU, or "measured, N GPUs" for a torchrun sweep, the CSV's
    `world`) or "emulated" (one CP rank emulated in one process: the CSV's `emulated` column); a `longest` with "≥" is a lower bound (no OOM found, or the search was
    cut by its budget). The Megatron rows are its constructor's answer to `cp_size`.
    """
    rows = []
    for d in sorted(p for p in Path(root).glob("cp_oom_*") if (p / "cp_oom_cells.csv").is_file()):
        with open(d / "cp_oom_cells.csv", newline="") as f:
            cells = list(csv.DictReader(f))
        for c in sorted(cells, key=lambda c: (c["ac"] != "True", int(c["cp"]))):
            oom = int(c["shortest_oom"]) if c["shortest_oom"] else None
            bound = "" if oom is not None and c["complete"] == "True" else "≥ "
            rows.append({"sweep": d.name, "preset": c["preset"], "ac": "on" if c["ac"] == "True" else "off",
                         "layout": f"FSDP cp{c['cp']}", "source": _cp_source(c),
                         "longest": bound + _k(int(c["longest"])), "first_oom": _k(oom),
                         "extrapolated": _k(int(float(c["extrapolated"]))) if c["extrapolated"] else "",
                         **{k: float(c[f"{k}_at_longest"]) if c[f"{k}_at_longest"] else None
                            for k in ("peak_gib", "tokens_per_s_per_gpu")}})
    for cp in sorted({int(r["layout"].removeprefix("FSDP cp")) for r in rows} - {1}):
        ok, why = megatron_accepts({"cp_size": cp})
        rows.append({"layout": f"Megatron cp{cp}", "source": "capability check",
                     "longest": _cell(ok, why, "accepted (not measured)")})
    return rows


def _cp_source(cell: dict) -> str:
    world = int(cell.get("world") or 1)  # sweeps written before the column: one process
    if cell["emulated"] == "True":
        return "emulated"
    return "measured" if world == 1 else f"measured, {world} GPUs"


# ============================================================================================== CLI
def main(argv: Sequence[str] | None = None) -> int:
    """`rlbench experiment fsdp-vs-megatron [flags]`: `convergence`, printed per step, written to `--out`."""
    p = argparse.ArgumentParser(prog="rlbench experiment fsdp-vs-megatron",
                                description="The same GRPO run (one SFT warm start, task and seeds) on each backend.")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--model", default=None, help="an SFT-warm-started HF directory (default: build one in --workdir)")
    p.add_argument("--sft-steps", type=int, default=None, help="SFT steps of the warm start (CPU 200, CUDA 150)")
    p.add_argument("--steps", type=int, default=4, help="GRPO steps per backend")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kl-loss-coef", type=float, default=0.01)
    p.add_argument("--lr", type=float, default=None, help="RL learning rate (default: the preset's)")
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    p.add_argument("--gpus", type=int, default=1, help="trainer GPUs; > 1: colocated Ray actors (FSDP DP = gpus)")
    p.add_argument("--tp", type=int, default=None, help="megatron TP with --gpus > 1 (default gpus / pp)")
    p.add_argument("--pp", type=int, default=1, help="megatron PP with --gpus > 1")
    p.add_argument("--sequence-parallel", action="store_true", help="megatron sequence parallel (TP > 1)")
    p.add_argument("--workdir", default=None, help="run files and the cached warm start (default: a temp dir)")
    p.add_argument("--out", default=None, help="result JSON (benchmarks/results/fsdp_vs_megatron_<date>.json)")
    a = p.parse_args(argv)

    def show(name, m):
        vals = " ".join(f"{k.split('/')[-1]} {m[k]:.4g}" for k in (*CURVE_KEYS, "perf/step_time") if k in m)
        print(f"[{name}] step {int(m['rollout/id']) + 1}: {vals}", flush=True)

    result = convergence(a.steps, a.backends, a.device, model=a.model, workdir=a.workdir, seed=a.seed,
                         sft_steps=a.sft_steps, kl_loss_coef=a.kl_loss_coef, lr=a.lr, on_step=show, gpus=a.gpus,
                         tp=a.tp, pp=a.pp, sequence_parallel=a.sequence_parallel)
    print("warm start", json.dumps(result["warm_start"]))
    for name, run in result["backends"].items():
        print(name, json.dumps(run["summary"]))
    print("checks", json.dumps(result["checks"]))
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
        print("wrote", a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
