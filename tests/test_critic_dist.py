"""PPO with a critic over 2 gloo ranks == 1 process: one RL step of `RankStep` (old / ref log-probs, the critic's
values, GAE with KL-in-reward whitened over DP, the critic's update, then the actor's) on a real FSDP backend with
its critic. The losses, grad norms, advantages' and returns' means and both models' parameters after the step
agree (the ranks sum gradients in another order: float32 rounding only)."""

from __future__ import annotations

import os

import pytest
import torch
from dist_utils import free_port, spawn

from rlbench.types import Sample

WORLD = 2
GBS = 8  # 16 samples: 2 optimizer steps per rollout


def make_samples(n: int = 16) -> list[Sample]:
    """Random tokens and rewards; every third sample has a loss-masked span inside its response (tool output)."""
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(n):
        prompt, resp = int(torch.randint(3, 8, (1,), generator=g)), int(torch.randint(4, 10, (1,), generator=g))
        mask = [1] * resp
        if i % 3 == 0:
            mask[1:3] = [0, 0]
        out.append(Sample(tokens=torch.randint(0, 120, (prompt + resp,), generator=g).tolist(), response_length=resp,
                          loss_mask=mask, advantage=float(torch.rand(1, generator=g)), index=i))
    return out


def run_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from rlbench.backends.fsdp.critic import FSDPActorCritic
    from rlbench.configs import BatchConfig, LossConfig, OptimConfig, TrainConfig
    from rlbench.configs.critic import CriticConfig
    from rlbench.orchestration.ray_dp import split_steps_by_dp
    from rlbench.rank_step import DPAllReduce, RankStep, SingleRank

    # AdamW's first steps are lr·g/(|g| + eps): with eps=1e-8 that is lr·sign(g), and where |g| is a rounding
    # residue the other summation order flips it; with eps=1 the step is linear in g, so the two worlds' weights
    # differ by float32 rounding only. Grad clipping is off (10 is above the norms) for the same reason.
    optim = OptimConfig(lr=0.05, eps=1.0, clip_grad=10.0)
    cfg = TrainConfig(model="tiny", ref_model="tiny", device="cpu", param_dtype="fp32", optim=optim,
                      critic=CriticConfig(lr=0.5))
    backend = FSDPActorCritic(cfg)
    backend.init()
    loss = LossConfig(advantage_estimator="gae", normalize_advantages=True, gamma=0.99, lambd=0.9, kl_coef=0.05,
                      kl_loss_type="k3", value_clip=0.1)
    reduce = DPAllReduce(backend.env.mesh["dp"].get_group()) if world > 1 else SingleRank()
    step = RankStep(BatchConfig(global_batch_size=GBS, use_dynamic_batch_size=True, max_tokens_per_gpu=24), loss,
                    backend, reduce=reduce)
    shards = split_steps_by_dp(make_samples(), GBS, world, True)
    packs = step.pack(shards[rank])
    before = {f"critic.{n}": p.full_tensor().clone() for n, p in backend.critic.model.named_parameters()}
    before |= {f"actor.{n}": p.full_tensor().clone() for n, p in backend.model.named_parameters()}
    old, ref, _ = step.compute_log_probs(packs, first_from_forward=True)
    values, _ = step.compute_values(packs)
    adv, returns, metrics = step.advantages_and_returns(packs, old, ref, values)
    metrics |= step.train_critic(packs, values, returns)
    metrics |= step.train(packs, old, ref, adv)
    params = {f"actor.{n}": p.full_tensor() for n, p in backend.model.named_parameters()}
    params |= {f"critic.{n}": p.full_tensor() for n, p in backend.critic.model.named_parameters()}
    if rank == 0:
        keep = {k: v for k, v in metrics.items() if not k.startswith("perf/")}
        torch.save({"metrics": keep, "params": params, "before": before, "n_mb": [len(s) for s in packs]},
                   os.path.join(out_dir, f"world{world}.pt"))
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("critic_dist")
    run_rank(0, 1, free_port(), str(out))  # the one-process reference, in this process
    spawn(run_rank, (WORLD, free_port(), str(out)), nprocs=WORLD)
    return torch.load(out / "world1.pt"), torch.load(out / "world2.pt")


def test_two_ranks_train_the_critic_and_the_actor_as_one_process(results):
    one, two = results
    m1, m2 = one["metrics"], two["metrics"]
    assert min(one["n_mb"]) > 1 and min(two["n_mb"]) > 1  # several micro-batches per step, on each rank
    for key in ("critic/loss", "critic/vf_loss", "critic/grad_norm", "critic/vf_clipfrac", "critic/values_mean",
                "critic/returns_mean", "train/loss", "train/pg_loss", "train/grad_norm", "train/ppo_kl"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key
    assert m1["critic/step"] == m2["critic/step"] == 2.0 and m1["train/step"] == m2["train/step"] == 2.0
    assert m1["critic/grad_norm"] > 0 and m1["critic/vf_loss"] > 0  # the critic's loss is live
    assert 0 < m1["critic/vf_clipfrac"] < 1  # value_clip=0.1 clips some tokens of the second step, not all
    assert one["params"].keys() == two["params"].keys()
    assert any(k.startswith("critic.score.") for k in one["params"])
    for name, p in one["params"].items():
        torch.testing.assert_close(two["params"][name], p, rtol=1e-5, atol=1e-6, msg=name)


def test_the_step_moved_both_models(results):
    """The comparison above can fail: every parameter of both models changed in the step."""
    one, _ = results
    unchanged = [n for n, p in one["params"].items() if torch.equal(p, one["before"][n])]
    assert not unchanged, unchanged[:5]
