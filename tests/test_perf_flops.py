"""`perf/mfu` counts the model FLOPs that ran: 6N per trained token, 2N per token of each log-prob forward.

With π_old from the first optimizer step's training forward (`compute_log_probs(first_from_forward=True)`) only
the later steps' tokens are recomputed; `RankStep` reports the global token count of each pass
(`perf/log_probs_tokens`, `perf/ref_log_probs_tokens`) and `Trainer._perf` uses exactly those.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlbench.algorithms import LossConfig
from rlbench.configs import BatchConfig
from rlbench.rank_step import RankStep
from rlbench.trainer import PEAK_FLOPS, Trainer, train_flops
from rlbench.types import Sample

N_PARAMS = 1_000_000


class FakeBackend:
    """Zero log-probs for every pack; records which packs each pass ran over."""

    def __init__(self) -> None:
        self.passes: list[tuple[str, int]] = []

    def compute_log_prob(self, packs, *, model="actor", with_entropy=False):
        self.passes += [(model, p.num_real_tokens) for p in packs]
        return [SimpleNamespace(log_probs=torch.zeros(len(p.response_index))) for p in packs]


class TwoEqualRanks:
    """The reductions of two DP ranks holding the same samples: sums double."""

    def sum(self, values):
        return [2 * v for v in values]

    def max(self, value):
        return value


def _steps(n_steps: int) -> list[list[Sample]]:
    g = torch.Generator().manual_seed(0)
    steps = []
    for s in range(n_steps):
        lengths = torch.randint(5, 30, (4,), generator=g).tolist()
        steps.append([Sample(tokens=torch.randint(1, 100, (n,), generator=g).tolist(), response_length=n - 2 - s)
                      for n in lengths])
    return steps


def _perf_on_h200(monkeypatch, samples, metrics) -> dict:
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    trainer = SimpleNamespace(device=torch.device("cuda"), num_params=N_PARAMS, _compiled_s=0.0, offload=False)
    return Trainer._perf(trainer, SimpleNamespace(samples=samples), metrics, step_time=10.0)


@pytest.mark.parametrize("n_steps", [1, 3])
@pytest.mark.parametrize("reduce", [None, TwoEqualRanks()], ids=["one_rank", "two_ranks"])
def test_mfu_counts_exactly_the_recomputed_tokens(monkeypatch, n_steps, reduce):
    steps = _steps(n_steps)
    tokens = [sum(s.total_length for s in step) for step in steps]  # this rank's tokens per optimizer step
    ranks = 2 if reduce is not None else 1
    batch = BatchConfig(global_batch_size=4, use_dynamic_batch_size=True, max_tokens_per_gpu=64)
    backend = FakeBackend()
    step = RankStep(batch, LossConfig(use_kl_loss=True), backend, reduce=reduce)
    packs = step.pack(steps)
    _, _, m = step.compute_log_probs(packs, first_from_forward=True)
    assert step.old_from_forward
    # old: steps 1.. only (step 0's π_old is its training forward); ref: every step; DP-global counts
    assert ("perf/log_probs_time" in m) == (n_steps > 1)
    assert m.get("perf/log_probs_tokens", 0.0) == ranks * sum(tokens[1:])
    assert m["perf/ref_log_probs_tokens"] == ranks * sum(tokens)
    assert sum(t for model, t in backend.passes if model == "actor") == sum(tokens[1:])

    times = {"perf/train_time": 2.0, "perf/log_probs_time": 0.5, "perf/ref_log_probs_time": 0.5}
    m |= times if n_steps > 1 else {k: v for k, v in times.items() if k != "perf/log_probs_time"}
    busy = 3.0 if n_steps > 1 else 2.5
    samples = [s for step in steps for s in step] * ranks  # the global batch
    flops = N_PARAMS * (6 * ranks * sum(tokens) + 2 * ranks * sum(tokens[1:]) + 2 * ranks * sum(tokens))
    assert train_flops(N_PARAMS, ranks * sum(tokens), m) == flops
    out = _perf_on_h200(monkeypatch, samples, m)
    assert out["perf/mfu"] == pytest.approx(flops / (busy * PEAK_FLOPS["H200"]), rel=1e-12)
    overcount = N_PARAMS * ranks * sum(tokens) * (6 + 2 * (n_steps > 1) + 2) / (busy * PEAK_FLOPS["H200"])
    assert (out["perf/mfu"] != pytest.approx(overcount, rel=1e-6)) == (n_steps > 1)  # the old rule was wrong


def test_mfu_counts_every_token_when_old_log_probs_are_all_recomputed(monkeypatch):
    """Without the first-step shortcut (`first_from_forward=False`) the old pass runs over every step."""
    steps = _steps(2)
    tokens = sum(s.total_length for step in steps for s in step)
    step = RankStep(BatchConfig(global_batch_size=4, use_dynamic_batch_size=True, max_tokens_per_gpu=64),
                    LossConfig(), FakeBackend())
    _, _, m = step.compute_log_probs(step.pack(steps))
    assert m["perf/log_probs_tokens"] == tokens and "perf/ref_log_probs_tokens" not in m
    m |= {"perf/train_time": 2.0}
    out = _perf_on_h200(monkeypatch, [s for step in steps for s in step], m)
    busy = 2.0 + m["perf/log_probs_time"]
    assert out["perf/mfu"] == pytest.approx(8 * N_PARAMS * tokens / (busy * PEAK_FLOPS["H200"]), rel=1e-12)
