"""The cp-oom experiment's outputs: every trial and every cell as CSV, the seeds-form markdown tables, the ratios."""

from __future__ import annotations

import csv
import dataclasses
import os

import torch

from rlbench.experiments.cp_oom_search import Cell


def ratios(cells: list[Cell]) -> dict[tuple[bool, int], tuple[str, float | None]]:
    """(ac, cp) -> (longest(cp) / longest(cp1) as text, extrapolated(cp) / extrapolated(cp1) or None), cp > 1.

    The measured ratio needs both limits found; a cp that trained `max_len` gives a lower bound ("≥")."""
    out = {}
    for c in sorted(cells, key=lambda c: (not c.ac, c.cp)):
        base = next((b for b in cells if b.cp == 1 and b.ac == c.ac), None)
        if c.cp == 1 or base is None:
            continue
        if base.shortest_oom is None or not base.complete or not base.longest:
            measured = "— (cp1's limit not found)"
        elif not c.complete:
            measured = "— (the search was cut by the time budget)"
        else:
            measured = f"{'≥ ' if c.shortest_oom is None else ''}{c.longest / base.longest:.2f}x"
        extra = c.extrapolated / base.extrapolated if c.extrapolated and base.extrapolated else None
        out[(c.ac, c.cp)] = (measured, extra)
    return out


TRIAL_COLUMNS = ("preset", "device", "world", "cp", "emulated", "ac", "response_len", "pack_tokens", "rank_tokens", "works",
                 "peak_gib", "step_s", "tokens_per_s_per_gpu", "loss", "grad_norm")
CELL_COLUMNS = ("preset", "device", "world", "cp", "emulated", "ac", "longest", "shortest_oom", "complete", "extrapolated",
                "peak_gib_at_longest", "tokens_per_s_per_gpu_at_longest", "state_gib", "trials", "seconds")


def write_results(cfg, cells: list[Cell], capacity_gib: float | None) -> None:
    """`cp_oom_trials.csv` (every trial), `cp_oom_cells.csv` (every cell) and `cp_oom.md` under `cfg.out`
    (`cfg`: the sweep's `CPOOMConfig`)."""
    os.makedirs(cfg.out, exist_ok=True)
    common = {"preset": cfg.preset, "device": cfg.device}
    with open(os.path.join(cfg.out, "cp_oom_trials.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, TRIAL_COLUMNS)
        w.writeheader()
        for c in cells:
            for t in c.trials:
                row = dataclasses.asdict(t) | common | {"emulated": t.emulated, "tokens_per_s_per_gpu": t.tokens_per_s_per_gpu}
                w.writerow({k: row[k] for k in TRIAL_COLUMNS})
    with open(os.path.join(cfg.out, "cp_oom_cells.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, CELL_COLUMNS)
        w.writeheader()
        for c in cells:
            best = c.at(c.longest)
            w.writerow(common | {"world": c.world, "cp": c.cp, "emulated": c.emulated, "ac": c.ac, "longest": c.longest,
                                 "shortest_oom": c.shortest_oom, "complete": c.complete, "extrapolated": c.extrapolated,
                                 "peak_gib_at_longest": best.peak_gib if best else None,
                                 "tokens_per_s_per_gpu_at_longest": best.tokens_per_s_per_gpu if best else None,
                                 "state_gib": c.state_gib, "trials": len(c.trials), "seconds": round(c.seconds, 1)})
    with open(os.path.join(cfg.out, "cp_oom.md"), "w") as f:
        f.write(markdown(cfg, cells, capacity_gib))


def _k(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 and n else str(n)


def _cell_text(c: Cell, length: int) -> str:
    t = c.at(length)
    if t is not None:
        return ("works" + (f" {t.peak_gib:.1f} GiB" if t.peak_gib is not None else "")) if t.works else "OOM"
    if length <= c.longest:
        return "(works)"
    if c.shortest_oom is not None and length >= c.shortest_oom:
        return "(OOM)"
    return "?"


def _longest_text(c: Cell, max_len: int) -> str:
    if c.shortest_oom is None:
        return f"≥ {_k(c.longest)}" if c.longest >= max_len else f"≥ {_k(c.longest)} (budget)"
    if not c.complete:
        return f"{_k(c.longest)}–{_k(c.shortest_oom)} (budget)"
    return _k(c.longest)


def markdown(cfg, cells: list[Cell], capacity_gib: float | None) -> str:
    """The seeds-form tables (rows `FSDP cpN`, columns of lengths, cells works / OOM) and the predicted ratios."""
    dev = torch.cuda.get_device_name() if cfg.device == "cuda" else "CPU"
    world = max((c.world for c in cells), default=1)
    cap = f", {capacity_gib:.1f} GiB usable per {'GPU' if cfg.device == 'cuda' else 'rank'}" if capacity_gib else ""
    if world > 1:
        how = (f"FSDP on {world} processes ({'GPUs' if cfg.device == 'cuda' else 'gloo ranks'}): cpN is dp {world}/N x "
               f"cp N, every DP rank training its own sequence (fp32 params, grads and Adam states sharded over all "
               f"{world}{', bf16 compute' if cfg.device == 'cuda' else ', fp32'}). Peaks are the largest rank's; a length "
               "works only if it works on every rank.")
    else:
        how = ("FSDP on one process (fp32 params, grads and Adam states"
               f"{', bf16 compute' if cfg.device == 'cuda' else ', fp32'}). `(emulated)` rows are an **emulation of one "
               f"CP rank** (rank {cfg.emulated_rank}) in one process: real per-rank activation, gathered-K/V and logits "
               "sizes; the whole one-GPU FSDP state (a real rank holds 1/cp of it), no communication.")
    lines = [f"# CP out-of-memory sweep: {cfg.preset}, {dev}{' x ' + str(world) if world > 1 else ''}{cap}", "",
             f"One training step (forward, backward, AdamW) on one sequence: {cfg.prompt_len} prompt tokens + the "
             f"response length of the column; {how}",
             "Cells: `works` (peak allocated GiB) / `OOM` as tried; `(works)` / `(OOM)` inferred from the search "
             "(memory grows with length); `?` unresolved.", ""]
    if cfg.device != "cuda":
        lines += ["CPU run: no allocator peak, OOMs only where planted; the machinery, not a measurement.", ""]
    grid = []
    n = cfg.start_len
    while n <= cfg.max_len:
        grid.append(n)
        n *= 2
    for ac in cfg.acs:
        rows = sorted((c for c in cells if c.ac == ac), key=lambda c: c.cp)  # cp order, whatever the run order
        lines += [f"## Activation checkpointing {'on' if ac else 'off'}", "",
                  "| | " + " | ".join(_k(n) for n in grid) + " | longest that trains | extrapolated |",
                  "|---|" + "---|" * (len(grid) + 2)]
        for c in rows:
            extra = _k(c.extrapolated) if c.extrapolated else "—"
            lines.append(f"| {c.label} | " + " | ".join(_cell_text(c, n) for n in grid)
                         + f" | {_longest_text(c, cfg.max_len)} | {extra} |")
        lines.append("")
    if world > 1:
        lines += ["## Length ratio vs cp1", "", f"Measured on {world} real ranks.", ""]
    else:
        lines += ["## Predicted length ratio vs cp1", "",
                  "From the emulated ranks, which hold the whole one-GPU FSDP state: lower bounds for a real CP run.", ""]
    for (ac, cp), (measured, extra) in ratios(cells).items():
        e = f"{extra:.2f}x" if extra else "—"
        lines.append(f"- AC {'on' if ac else 'off'}, cp{cp}/cp1: longest that trains {measured}; extrapolated {e}")
    lines += ["", "| cell | AC | state GiB | peak GiB at longest | tokens/s/GPU at longest | trials | seconds |",
              "|---|---|---|---|---|---|---|"]
    for c in cells:
        best = c.at(c.longest)
        peak = f"{best.peak_gib:.1f}" if best and best.peak_gib is not None else "—"
        speed = f"{best.tokens_per_s_per_gpu:.0f}" if best and best.tokens_per_s_per_gpu else "—"
        state = f"{c.state_gib:.1f}" if c.state_gib is not None else "—"
        lines.append(f"| {c.label} | {'on' if c.ac else 'off'} | {state} | {peak} | {speed} | {len(c.trials)} | "
                     f"{c.seconds:.0f} |")
    return "\n".join(lines) + "\n"
