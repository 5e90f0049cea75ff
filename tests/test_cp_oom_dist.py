"""The cp-oom experiment on real ranks (2 gloo processes, as under `torchrun --nproc_per_node 2`): cp1 = dp 2 and
cp2 = dp 1 x cp 2 through the backend's own CP path, planted out-of-memory limits, both ranks probing the same
lengths and rank 0 writing the seeds-form table without `(emulated)` rows."""

from __future__ import annotations

import csv
import math
import os
import sys
from pathlib import Path

import torch
from dist_utils import free_port, spawn

sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))
from stored_results import cp_oom_rows  # noqa: E402  (the reader notebook 04's CP table uses)

PLANTED = {1: 700, 2: 1400}  # cp -> longest response that "fits"


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from rlbench.experiments import cp_oom

    cfg = cp_oom.CPOOMConfig(preset="tiny", device="cpu", cps=(1, 2), acs=(True,), start_len=128, max_len=2048,
                             resolution=128, time_budget_s=600, out=out)
    cells = cp_oom.run_cp_oom(cfg, planted_oom=lambda cp, ac, n: n > PLANTED[cp])
    torch.save([(c.cp, c.longest, c.shortest_oom, c.complete, c.world, c.label,
                 [(t.response_len, t.works, t.loss, t.rank_tokens, t.pack_tokens) for t in c.trials]) for c in cells],
               os.path.join(out, f"rank{rank}.pt"))


def test_cp_oom_on_two_ranks_finds_the_planted_limits(tmp_path):
    spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert ranks[0] == ranks[1]  # the same lengths in the same order, the same verdicts and losses
    for cp, longest, shortest, complete, world, label, trials in ranks[0]:
        assert (longest, shortest, complete, world) == (PLANTED[cp] // 128 * 128, PLANTED[cp] // 128 * 128 + 128, True, 2)
        assert label == f"FSDP cp{cp}"  # real ranks: no emulation
        for n, works, loss, rank_tokens, pack_tokens in trials:
            assert works == (n <= PLANTED[cp]) and rank_tokens * cp == pack_tokens
            if works:  # the token mean over both ranks' sequences: ~ln(128) for a random init, at cp1 and cp2
                assert abs(loss - math.log(128)) < 0.5
    md = (tmp_path / "cp_oom.md").read_text()
    assert "FSDP on 2 processes" in md and "(emulated)" not in md
    assert "- AC on, cp2/cp1: longest that trains 2.00x" in md
    rows = list(csv.DictReader(open(tmp_path / "cp_oom_cells.csv")))
    assert [(r["world"], r["cp"], r["emulated"], r["longest"]) for r in rows] == [
        ("2", "1", "False", "640"), ("2", "2", "False", "1280")]
    sweep = tmp_path / "results" / "cp_oom_2gpu"  # as stored under benchmarks/results/ for notebook 04's table
    sweep.mkdir(parents=True)
    (tmp_path / "cp_oom_cells.csv").rename(sweep / "cp_oom_cells.csv")
    table = cp_oom_rows(tmp_path / "results")
    assert [(r["layout"], r["source"], r["longest"]) for r in table] == [
        ("FSDP cp1", "measured, 2 GPUs", "640"), ("FSDP cp2", "measured, 2 GPUs", "1280")]
