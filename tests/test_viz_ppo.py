"""rlbench.viz.ppo_view: per-token traces read back from packs by hand-built values, and the figures' traces."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlbench.viz.ppo_view import TokenTraceView, eval_figure, kl_figure, token_trace_figure, token_traces


def _batch(with_critic: bool = True):
    # two optimizer steps of 2 samples; step 0 packs its samples in reverse order, one masked token in sample 1
    samples = [SimpleNamespace(reward=float(i), response=f"r{i}") for i in range(4)]
    p00 = SimpleNamespace(sample_ids=[1, 0], response_lengths=[2, 3], loss_mask=torch.tensor([1.0, 0.0, 1, 1, 1]))
    p10 = SimpleNamespace(sample_ids=[0], response_lengths=[1], loss_mask=torch.tensor([1.0]))
    p11 = SimpleNamespace(sample_ids=[1], response_lengths=[2], loss_mask=torch.tensor([1.0, 1.0]))
    adv = [[torch.tensor([10.0, 11, 12, 13, 14])], [torch.tensor([20.0]), torch.tensor([30.0, 31])]]
    val = [[torch.tensor([0.5, 0.6, 0.7, 0.8, 0.9])], [torch.tensor([1.5]), torch.tensor([2.5, 2.6])]]
    ret = [[a + 100 for a in step] for step in adv]
    return SimpleNamespace(samples=samples, packs=[[p00], [p10, p11]], advantages=adv,
                           values=val if with_critic else None, returns=ret if with_critic else None)


def test_token_traces_by_hand():
    traces = token_traces(_batch())
    assert [t["sample"] for t in traces] == [0, 1, 2, 3]
    assert traces[0] == {"sample": 0, "reward": 0.0, "response": "r0", "advantages": [12.0, 13.0, 14.0],
                         "values": [pytest.approx(0.7), pytest.approx(0.8), pytest.approx(0.9)],
                         "returns": [112.0, 113.0, 114.0]}
    assert traces[1]["advantages"] == [10.0] and traces[1]["returns"] == [110.0]  # its 2nd token is masked
    assert traces[2]["advantages"] == [20.0] and traces[3]["advantages"] == [30.0, 31.0]
    assert traces[3]["values"] == [2.5, pytest.approx(2.6)] and traces[3]["reward"] == 3.0
    assert len(token_traces(_batch(), limit=2)) == 2
    grpo = token_traces(_batch(with_critic=False))
    assert grpo[3]["values"] is None and grpo[3]["returns"] is None and grpo[3]["advantages"] == [30.0, 31.0]
    with pytest.raises(ValueError, match="has no advantages"):
        token_traces(SimpleNamespace(packs=None, advantages=None))


def test_figures_carry_the_data():
    traces = token_traces(_batch())
    fig = token_trace_figure(traces[0])
    assert [tr.name for tr in fig.data] == ["value", "return", "advantage"]
    assert list(fig.data[1].y) == [112.0, 113.0, 114.0]
    assert [tr.name for tr in token_trace_figure(token_traces(_batch(with_critic=False))[0]).data] == ["advantage"]
    view = TokenTraceView(traces, backend="output")
    view.slider.value = 3  # what dragging the slider does
    assert list(view.view.figure.data[2].y) == [30.0, 31.0]
    history = [{"rollout/id": 0, "rollout/reward_kl": 0.02, "rollout/kl_coef": 0.05},
               {"rollout/id": 1, "rollout/reward_kl": 0.2, "rollout/kl_coef": 0.051}]
    kl = kl_figure({"ppo": history}, target=0.1)
    assert list(kl.data[0].y) == [0.02, 0.2] and list(kl.data[1].y) == [0.05, 0.051]
    assert kl.layout.shapes[0].y0 == 0.1
    ev = eval_figure({"a": [{"rollout/id": 0, "hidden": 0.4}, {"rollout/id": 5, "hidden": 0.8}]}, ["hidden"])
    assert list(ev.data[0].x) == [0, 5] and list(ev.data[0].y) == [0.4, 0.8]
