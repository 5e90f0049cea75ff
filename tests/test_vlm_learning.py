"""A tiny VLM learns the shapes colour task on a CPU (slow: a warm start of about 70 SFT steps, then 30 GRPO steps;
about 1 min on 2 cores at one thread).

tiny-vl (vision tower frozen at its random init) is SFT-warmed until p(answer) on training rows reaches 0.45, so
GRPO starts with headroom; the warm start reads the image (its held-out pass@1 drops below chance when every prompt
gets another prompt's image) and GRPO raises held-out pass@1 at temperature 1 and greedy. The 3-seed curves are in
docs/log/2026-12.md (2026-12-08, VLM learning curve).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("PIL")

from rlbench import Trainer, presets  # noqa: E402
from rlbench.configs import EvalConfig  # noqa: E402
from rlbench.data.shapes import write_shapes_task  # noqa: E402
from rlbench.vlm_sft import ShapesSFTConfig, shapes_warm_start  # noqa: E402

pytestmark = pytest.mark.slow

GREEDY = EvalConfig(temperature=0.0)
SAMPLED = EvalConfig(n_samples_per_prompt=4, pass_k=(1,), temperature=1.0)


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """(warm start dir, train jsonl, held-out jsonl) of seed 0, built at one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("vlm")
    data = str(root / "data")
    train, held_out = write_shapes_task(data, kind="colour", n_train=512, n_eval=64, seed=0)
    model = shapes_warm_start(ShapesSFTConfig(seed=0, data_dir=data, out=str(root / "warm")))
    torch.set_num_threads(threads)
    return model, train, held_out


def _trainer(warm, workdir, num_rollout: int) -> Trainer:
    model, train, held_out = warm
    return Trainer(presets.cpu_vlm_shapes(model, train, held_out, workdir, seed=0, num_rollout=num_rollout))


def test_the_warm_start_reads_the_image(warm, tmp_path, one_thread):
    """Held-out pass@1 of the warm start is above chance (1/4) with each prompt's own image, below it with another
    prompt's image (the labels kept; 0.441 and 0.137 at seed 0): the answer comes from the image, not the text."""
    trainer = _trainer(warm, str(tmp_path), 1)
    items = trainer.eval_items
    own = trainer.rollouts.evaluate(items, SAMPLED)["eval/pass@1"]
    shifted = [dataclasses.replace(it, images=items[(i + 1) % len(items)].images) for i, it in enumerate(items)]
    other = trainer.rollouts.evaluate(shifted, SAMPLED)["eval/pass@1"]
    trainer.close()
    assert 0.35 <= own <= 0.7, own  # headroom left for GRPO
    assert other <= 0.33 and own >= other + 0.15, (own, other)


def test_grpo_raises_held_out_accuracy(warm, tmp_path, one_thread):
    trainer = _trainer(warm, str(tmp_path), 30)
    greedy_before = trainer.rollouts.evaluate(trainer.eval_items, GREEDY)["eval/pass@1"]
    trainer.fit()
    greedy_after = trainer.rollouts.evaluate(trainer.eval_items, GREEDY)["eval/pass@1"]
    curve = [e["eval/pass@1"] for e in trainer.eval_history]  # sampled, temperature 1: rollouts 0, 5, ..., 30
    trainer.close()
    assert len(curve) == 7
    assert curve[-1] >= curve[0] + 0.12, curve  # seed 0 at one thread: 0.441 -> 0.645
    assert min(curve[-2:]) > max(curve[:2]), curve
    assert greedy_after >= greedy_before + 0.08, (greedy_before, greedy_after)  # 0.688 -> 0.859
