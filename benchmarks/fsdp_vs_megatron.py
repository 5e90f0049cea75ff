"""FSDP vs Megatron: one GRPO run (one SFT warm start, task and seeds) on both training backends, and the CP table.

    result = convergence(steps=4)               # each backend in turn; the record notebook 04 and the JSON hold
    rows = cp_oom_table()                       # the stored CP-OOM sweeps + megatron's answer to cp_size

    rlbench experiment fsdp-vs-megatron --device cuda --sft-steps 500 --steps 8 --lr 1e-5 \
        --out benchmarks/results/fsdp_vs_megatron_<date>_sft500.json      # docs/megatron.md, "to reproduce"
    python benchmarks/fsdp_vs_megatron.py ...                             # the same

The feature table is `backend_features.py`; stored results are read by `stored_results.py` (both beside this file).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # the sibling modules; appended: never shadows a package
from backend_features import megatron_accepts, package_version  # noqa: E402
from stored_results import (  # noqa: E402
    CURVE_KEYS,
    RESULTS_DIR,
    checks,
    cp_oom_rows,
    step_record,
    summarize,
)

from rlbench.configs.run import TRAIN_BACKENDS  # noqa: E402

BACKENDS = TRAIN_BACKENDS
"""The backends compared (`RunConfig.train_backend` values)."""
WHAT = "the same SFT warm start, task and seeds on the FSDP and the megatron backend"


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
    run_sft(cfg)  # its progress lines go to stdout: in a notebook, plain output rather than a red stderr box
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


def collect(trainers: Mapping[str, Any], meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The result of already-stepped trainers (e.g. a `TrainerGroup` run in the notebook), as `convergence`
    returns it."""
    runs = {}
    for name, t in trainers.items():
        steps = [step_record(m) for m in t.history]
        runs[name] = {"steps": steps, "summary": summarize(steps)}
    return {"what": WHAT, **dict(meta or {}), "backends": runs, "checks": checks(runs)}


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


# ============================================================================================== CP-OOM table
def cp_oom_table(root: str | Path = RESULTS_DIR) -> list[dict[str, Any]]:
    """The CP out-of-memory table: the stored FSDP sweeps (`stored_results.cp_oom_rows`, each row measured or
    emulated), then one row per CP size for Megatron: its constructor's answer to `cp_size` (never measured)."""
    rows = cp_oom_rows(root)
    for cp in sorted({int(r["layout"].removeprefix("FSDP cp")) for r in rows} - {1}):
        ok, why = megatron_accepts({"cp_size": cp})
        rows.append({"layout": f"Megatron cp{cp}", "source": "capability check",
                     "longest": "accepted (not measured)" if ok else f"no ({why})"})
    return rows


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
