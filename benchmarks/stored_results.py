"""The one reader of the result files in `benchmarks/results/`: it knows their schemas, so nothing in `rlbench/` does.

Each function takes the parsed JSON (or a directory) a benchmark wrote and returns plain rows: `{column: value}`
dicts, with `(key, header)` column lists for `rlbench.viz.on_policy.table_html`, or `{run: per-step metric
dicts}` for `rlbench.viz.on_policy.metric_curves`. Notebooks and benchmark scripts import it the way the
benchmarks import each other (this directory on `sys.path`):

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import stored_results as sr
    path = sr.newest_result(sr.RESULTS_DIR, "mismatch_")            # the newest dated file of one benchmark
    rows = sr.mismatch_summary(json.loads(path.read_text()))        # benchmarks/mismatch.py
    rows = sr.cost_table(json.loads(...))                           # benchmarks/true_on_policy.py
    rows = sr.cost_table(sr.e2e_cost_rows(json.loads(...)))         # `rlbench bench e2e --true-on-policy`
    runs = sr.fsdp_vs_megatron_results()                            # `rlbench experiment fsdp-vs-megatron`
    rows = sr.cp_oom_rows()                                         # `rlbench experiment cp-oom` sweeps

Imports no torch, plotly or rlbench module, so a benchmark script on a bare GPU box can use it too.
"""

from __future__ import annotations

import csv
import json
import math
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"
"""Where the stored results are."""


REPO_DIRS = ("rlbench", "benchmarks", "tests", "examples", "tools", "docs", "notebooks", "data")
ABS_PATH = re.compile(r"(?<![\w.~:/-])/(?:[\w.+@-]+/)*[\w.+@-]+")


def portable_command(text: str) -> str:
    """A stored command line without the absolute paths of the machine that ran it.

    A path inside a checkout of this repository (`/work/main/rlbench/cli.py`) becomes repository-relative
    (`rlbench/cli.py`); any other (`/tmp/fvm06`, `/root/out/e2e.json`) keeps its last component only.
    """
    def short(m: re.Match) -> str:
        parts = m.group(0).strip("/").split("/")
        inside = next((i for i, part in enumerate(parts) if i > 0 and part in REPO_DIRS), None)
        return "/".join(parts[inside:]) if inside is not None else parts[-1]

    return ABS_PATH.sub(short, text)


# ---------------------------------------------------------------------------------------------- finding files
def newest_result(directory: str | Path, prefix: str) -> Path | None:
    """The newest `<prefix><YYYY-MM-DD>.json` in `directory` (what the benchmarks write by default), or None.

    Variants with a suffix (`<prefix><date>_seed1.json`, written with `--out`) count only when there is no plain
    dated file; among them the last by name wins.
    """
    files = sorted(Path(directory).glob(f"{prefix}*.json"))
    dated = [f for f in files if re.fullmatch(rf"{re.escape(prefix)}\d{{4}}-\d{{2}}-\d{{2}}\.json", f.name)]
    return (dated or files or [None])[-1]


def number(value: Any) -> float | None:
    """`value` as a finite float (python / numpy numbers), else None (bools, strings, NaN, missing)."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def values(steps: Iterable[Mapping[str, Any]], key: str) -> list[float]:
    """The finite values of `key` over per-step metric dicts (steps without it skipped)."""
    return [v for v in (number(s.get(key)) for s in steps) if v is not None]


def _mean(steps: Iterable[Mapping[str, Any]], key: str) -> float | None:
    found = values(steps, key)
    return sum(found) / len(found) if found else None


# ---------------------------------------------------------------------------------------------- cost tables
MODES = ("default", "true_on_policy", "true_on_policy_rollout_logprobs")
"""The rows of `benchmarks/true_on_policy.py`: default numerics; the true on-policy mode recomputing old
log-probs; the mode with old = the rollout's log-probs (`use_rollout_logprobs`, no recompute: the same bits)."""
COST_KEYS = {"rollout_tokens_per_s": "perf/rollout_tokens_per_sec", "rollout_time_s": "perf/rollout_time",
             "logprob_time_s": "perf/log_probs_time", "train_time_s": "perf/train_time",
             "step_time_s": "perf/step_time",
             "train_rollout_logprob_abs_diff": "train/train_rollout_logprob_abs_diff",
             "first_mb_kl_vs_rollout": "train/first_mb_kl_vs_rollout"}
"""Cost-table column -> the trainer's step metric (`benchmarks/true_on_policy.py` rows, `history_row`)."""
RATIO_KEYS = ("rollout_tokens_per_s", "rollout_time_s", "logprob_time_s", "train_time_s", "step_time_s")
"""Columns `cost_table` divides by the baseline row's (`<key>_x`)."""
COST_COLUMNS = (
    ("preset", "preset"), ("mode", "mode"), ("steps", "steps"),
    ("rollout_tokens_per_s", "rollout tok/s"), ("rollout_tokens_per_s_x", "tok/s × default"),
    ("rollout_time_s", "rollout s"), ("logprob_time_s", "log-prob s"), ("train_time_s", "train s"),
    ("step_time_s", "step s"), ("step_time_s_x", "step × default"),
    ("train_rollout_logprob_abs_diff", "|rollout − recompute|"),
    ("first_mb_kl_vs_rollout", "|rollout − 1st train fwd|"),
)
"""`(row key, header)` of the cost table, in order."""
E2E_MODES = {"rlbench": "default", "rlbench-top": "true_on_policy"}
"""`rlbench bench e2e --true-on-policy` systems -> cost-table modes (old log-probs from the training forward in both)."""


def history_row(history: Sequence[Mapping[str, Any]], *, preset: str, mode: str, skip: int = 1) -> dict:
    """A cost-table row (the `COST_KEYS` columns) from a trainer's `history`.

    Means over the steps after the first `skip` (warm-up); with no more steps than that, over all of them.
    A metric no step logged (log-prob time without a recompute) is None.
    """
    steps = list(history[skip:]) if len(history) > skip else list(history)
    return {"preset": preset, "mode": mode, "steps": len(steps),
            **{col: _mean(steps, key) for col, key in COST_KEYS.items()}}


def newest_e2e_with_mode(directory: str | Path) -> Path | None:
    """The newest `e2e_*.json` in `directory` (by its "date", then its name) that ran the true on-policy mode."""
    found = []
    for path in Path(directory).glob("e2e_*.json"):
        result = json.loads(path.read_text())
        if "rlbench-top" in result.get("rows", {}):
            found.append((str(result.get("date", "")), path.name, path))
    return max(found)[2] if found else None


def e2e_cost_rows(result: Mapping[str, Any]) -> list[dict]:
    """Cost-table rows from an `rlbench bench e2e --true-on-policy` result: its steady-state medians per system,
    the defaults and the mode side by side in one run."""
    preset = result.get("workload", {}).get("model")
    rows = []
    for system, mode in E2E_MODES.items():
        r = result.get("rows", {}).get(system)
        if r is None:
            continue
        phases = r.get("phases_s", {})
        rows.append({
            "preset": preset, "mode": mode, "steps": r.get("measured_steps"),
            "rollout_tokens_per_s": r.get("rollout_tokens_per_s"), "rollout_time_s": phases.get("rollout"),
            "logprob_time_s": phases.get("log_probs"), "train_time_s": phases.get("train"),
            "step_time_s": r.get("steady_step_s"), "train_rollout_logprob_abs_diff": r.get("max_logprob_abs_diff"),
            "first_mb_kl_vs_rollout": r.get("max_first_mb_kl_vs_rollout"),
        })
    return rows


def cost_table(result: Mapping[str, Any] | Sequence[Mapping[str, Any]], *, baseline: str = "default",
               ratio_keys: Sequence[str] = RATIO_KEYS) -> list[dict]:
    """Rows with `<key>_x` = value / the value of the same preset's `baseline` row (None when either is missing,
    or the preset has no baseline row); `result` is the JSON dict (its `rows`) or the rows themselves."""
    rows = [dict(r) for r in (result["rows"] if isinstance(result, Mapping) else result)]
    base = {}
    for r in rows:
        if r.get("mode") == baseline:
            base.setdefault(r.get("preset"), r)
    for r in rows:
        ref = base.get(r.get("preset"))
        for k in ratio_keys:
            v, b = r.get(k), ref.get(k) if ref else None
            r[f"{k}_x"] = v / b if isinstance(v, (int, float)) and isinstance(b, (int, float)) and b else None
    return rows


# ---------------------------------------------------------------------------------------------- mismatch
MISMATCH_COLUMNS = (
    ("setting", "setting"), ("engine", "engine"), ("loss", "loss mode"), ("steps", "steps"),
    ("reward_first", "reward (first steps)"), ("reward_last", "reward (last steps)"),
    ("pass@1_first", "eval pass@1 (start)"), ("pass@1_last", "eval pass@1 (end)"),
    ("abs_diff", "mean |rollout − recompute|"), ("k3_kl", "mean mismatch k3 KL"), ("ppo_kl", "mean ppo_kl"),
    ("grad_norm", "mean grad norm"),
)
"""`(row key, header)` of `mismatch_summary`'s table."""
GRADIENT_BIAS_COLUMNS = (
    ("setting", "setting"), ("cos", "cos to g_true (one batch)"), ("cos_sd", "± sd"), ("norm", "grad norm"),
    ("cos_expected", "cos of expected gradients"), ("norm_expected", "expected grad norm"),
)
"""`(row key, header)` of `gradient_bias_rows`'s table."""


def mismatch_runs(result: Mapping[str, Any]) -> dict[str, list[dict]]:
    """`{setting: per-step metric dicts}` from a `benchmarks/mismatch.py` result.

    Accepts `{"settings": {name: {"steps": [...]}}}` (the script's layout), `{"settings": {name: [...]}}` and a
    plain `{name: [...]}`; entries that are neither are skipped.
    """
    settings = result.get("settings", result)
    out = {}
    for name, value in settings.items():
        steps = value.get("steps") if isinstance(value, Mapping) else value
        if isinstance(steps, list) and all(isinstance(s, Mapping) for s in steps):
            out[name] = [dict(s) for s in steps]
    return out


def mismatch_summary(result: Mapping[str, Any], *, window: int | None = None) -> list[dict]:
    """One row per setting of a `benchmarks/mismatch.py` result, computed from its per-step metrics.

    Reward means over the first and last `window` steps (default: a quarter of the run, 1 to 10 steps), eval
    pass@1 at the first and last eval (when the setting has an `eval` list), and the mean per step of the
    mismatch diagnostics; the engine dtype and loss mode come from the setting's `config` when it has one.
    """
    settings = result.get("settings", result)
    out = []
    for name, steps in mismatch_runs(result).items():
        meta = settings.get(name) if isinstance(settings.get(name), Mapping) else {}
        config, evals = meta.get("config") or {}, [e for e in meta.get("eval") or [] if "eval/pass@1" in e]
        w = window or max(1, min(10, len(steps) // 4))
        out.append({
            "setting": name, "engine": config.get("engine_dtype"), "loss": config.get("loss_mode"),
            "steps": len(steps), "reward_first": _mean(steps[:w], "rollout/raw_reward"),
            "reward_last": _mean(steps[-w:], "rollout/raw_reward"),
            "pass@1_first": evals[0]["eval/pass@1"] if evals else None,
            "pass@1_last": evals[-1]["eval/pass@1"] if evals else None,
            "abs_diff": _mean(steps, "train/train_rollout_logprob_abs_diff"),
            "k3_kl": _mean(steps, "train/mismatch_k3_kl"), "ppo_kl": _mean(steps, "train/ppo_kl"),
            "grad_norm": _mean(steps, "train/grad_norm"),
        })
    return out


def _step_of(i: int, m: Mapping[str, Any]) -> int:
    """A per-step dict's step number: `step`, else `rollout/id` + 1, else its position + 1."""
    if number(m.get("step")) is not None:
        return int(m["step"])
    rid = number(m.get("rollout/id"))
    return int(rid) + 1 if rid is not None else i + 1


def eval_by_step(runs: Mapping[str, Iterable[Mapping[str, Any]]], key: str = "eval/pass@1",
                 seed_suffix: str = "_seed") -> tuple[list[dict], list[tuple[str, str]]]:
    """`key` at every step a run logged it: one row per run, plus one "<setting> (mean)" row per setting that has
    runs named `<setting><seed_suffix><k>` (the mean over its seeds at the steps all of them logged).
    Returns (rows, `table_html` columns)."""
    rows = [{"setting": name, **{f"step {_step_of(i, m)}": number(m.get(key)) for i, m in enumerate(h)
                                 if number(m.get(key)) is not None}}
            for name, h in runs.items()]
    steps = sorted({int(k[5:]) for r in rows for k in r if k.startswith("step ")})
    groups: dict[str, list[dict]] = {}
    for r in rows:
        if seed_suffix in r["setting"]:
            groups.setdefault(r["setting"].rsplit(seed_suffix, 1)[0], []).append(r)
    for setting, members in groups.items():
        mean = {f"step {x}": sum(m[f"step {x}"] for m in members) / len(members)
                for x in steps if all(f"step {x}" in m for m in members)}
        rows.append({"setting": f"{setting} (mean of {len(members)})", **mean})
    return rows, [("setting", "setting")] + [(f"step {x}", f"{key} @ {x}") for x in steps]


def gradient_bias_rows(result: Mapping[str, Any]) -> list[dict]:
    """One row per setting of a `benchmarks/mismatch_grad.py` result: the cosine of one batch's gradient to the
    clean policy's on-policy gradient (mean, sd over draws), its norm, and the cosine of the expected gradients."""
    return [{"setting": name, "cos": s["cos_to_g_true"]["mean"], "cos_sd": s["cos_to_g_true"]["sd"],
             "norm": s["norm"]["mean"], "cos_expected": s.get("cos_expected_to_g_true"),
             "norm_expected": s.get("norm_expected")}
            for name, s in result.get("summary", {}).items()]


# ---------------------------------------------------------------------------------------------- FSDP vs Megatron
FVM_BACKENDS = ("fsdp", "megatron")
"""The backends of an `rlbench experiment fsdp-vs-megatron` result (`RunConfig.train_backend` values)."""
CURVE_KEYS = ("rollout/raw_reward", "train/kl_loss", "train/train_rollout_logprob_abs_diff", "train/grad_norm")
"""The per-step curves overlaid: reward, KL to the reference (the loss term), |train − rollout| log-prob per
token, the global grad norm."""
STEP_KEYS = CURVE_KEYS + (
    "train/loss", "train/pg_loss", "train/ppo_kl", "train/first_mb_kl_vs_rollout", "train/skipped", "rollout/id",
    "rollout/response_len/mean", "perf/step_time", "perf/rollout_time", "perf/log_probs_time", "perf/train_time",
    "perf/update_weights_time", "perf/peak_memory_gb",
)
"""Per-step metrics a comparison record keeps (those the step reported)."""
FVM_COST_COLUMNS = (("result", "result"), ("backend", "backend"), ("steps", "steps"),
                    ("first_step_time_s", "first step s"), ("step_time_s_median", "step s (median, after the first)"),
                    ("peak_memory_gb", "peak GiB"), ("reward_mean", "mean reward"))
"""`(key, header)` of `fvm_cost_rows`."""


def step_record(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The `STEP_KEYS` of one step's metrics (those reported)."""
    return {k: float(metrics[k]) for k in STEP_KEYS if k in metrics}


def summarize(steps: Sequence[Mapping[str, float]]) -> dict[str, Any]:
    """Median step time after the first (warm-up) step, the first step's time, peak memory (CUDA), mean reward."""
    times, peaks = values(steps, "perf/step_time"), values(steps, "perf/peak_memory_gb")
    rewards = values(steps, "rollout/raw_reward")
    return {"steps": len(steps),
            "step_time_s_median": statistics.median(times[1:] or times) if times else None,
            "first_step_time_s": times[0] if times else None,
            "peak_memory_gb": max(peaks) if peaks else None,
            "reward_mean": statistics.fmean(rewards) if rewards else None}


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


def load_fvm_result(path: str | Path) -> dict[str, Any]:
    """A stored FSDP-vs-Megatron comparison: a `convergence` JSON (`benchmarks/fsdp_vs_megatron.py`) as written,
    or a directory of per-backend metric files `<backend>.jsonl` (what `rlbench bench --train-backend B`
    writes; summaries and checks computed here from the per-step rows)."""
    path = Path(path)
    if path.is_file():
        return json.loads(path.read_text())
    runs = {}
    for name in FVM_BACKENDS:
        if (path / f"{name}.jsonl").is_file():
            steps = [step_record(json.loads(line)) for line in (path / f"{name}.jsonl").read_text().splitlines()
                     if line.strip()]
            runs[name] = {"steps": steps, "summary": summarize(steps)}
    if not runs:
        raise ValueError(f"{path}: neither a result JSON nor a directory with {' / '.join(FVM_BACKENDS)}.jsonl")
    return {"source": path.name, "backends": runs, "checks": checks(runs)}


def fsdp_vs_megatron_results(root: str | Path = RESULTS_DIR) -> dict[str, dict[str, Any]]:
    """Every stored `fsdp_vs_megatron_*` (JSON or directory) under `root`, by name without the prefix (and
    without ".json" unless a directory has that name), in name order."""
    prefix, out = "fsdp_vs_megatron_", {}
    for p in sorted(p for p in Path(root).glob(f"{prefix}*") if p.is_dir() or p.suffix == ".json"):
        name = p.name[len(prefix):]
        out[name if name.removesuffix(".json") in out else name.removesuffix(".json")] = load_fvm_result(p)
    return out


def curve_runs(results: Mapping[str, Mapping[str, Any]]) -> dict[str, list[dict]]:
    """`{"<backend> <name>": per-step records}` of several comparisons, for `metric_curves`."""
    return {f"{b} {name}": run["steps"] for name, r in results.items() for b, run in r["backends"].items()}


def fvm_cost_rows(results: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per (result, backend): its summary (step time, peak memory, mean reward)."""
    return [{"result": name, "backend": b, **run["summary"]}
            for name, r in results.items() for b, run in r["backends"].items()]


# ---------------------------------------------------------------------------------------------- CP out of memory
CP_OOM_COLUMNS = (("sweep", "sweep"), ("preset", "preset"), ("ac", "AC"), ("layout", "layout"),
                  ("source", "source"), ("longest", "longest that trains"), ("first_oom", "first OOM"),
                  ("extrapolated", "extrapolated"), ("peak_gib", "peak GiB at longest"),
                  ("tokens_per_s_per_gpu", "tokens/s/GPU at longest"))
"""`(key, header)` of `cp_oom_rows`."""


def kilo(n: int | None) -> str:
    """A token count as the tables print it: "14k" for multiples of 1024, else the number ("" for None)."""
    return "" if n is None else f"{n // 1024}k" if n % 1024 == 0 and n else str(n)


def _cp_source(cell: Mapping[str, str]) -> str:
    world = int(cell.get("world") or 1)  # sweeps written before the column: one process
    if cell["emulated"] == "True":
        return "emulated"
    return "measured" if world == 1 else f"measured, {world} GPUs"


def cp_oom_rows(root: str | Path = RESULTS_DIR) -> list[dict[str, Any]]:
    """The CP out-of-memory table from the stored sweeps (`cp_oom_*/cp_oom_cells.csv`, written by
    `rlbench experiment cp-oom`): one row per (sweep, AC, FSDP cp size).

    `source` is "measured" (a real run of that layout: one GPU, or "measured, N GPUs" for a torchrun sweep, the
    CSV's `world`) or "emulated" (one CP rank emulated in one process: the CSV's `emulated` column); a `longest`
    with "≥" is a lower bound (no OOM found, or the search was cut by its budget); `extrapolated` is the sweep's
    fit beyond what it measured, never a measurement.
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
                         "longest": bound + kilo(int(c["longest"])), "first_oom": kilo(oom),
                         "extrapolated": kilo(int(float(c["extrapolated"]))) if c["extrapolated"] else "",
                         **{k: float(c[f"{k}_at_longest"]) if c[f"{k}_at_longest"] else None
                            for k in ("peak_gib", "tokens_per_s_per_gpu")}})
    return rows
