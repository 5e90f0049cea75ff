"""FSDPBackend with cp_size > 1 (gloo, CPU, fp32) against cp=1 on the same global batch.

Spawns: 1 process (the cp=1 reference), 2 processes (cp=2, then cp=2 with KV-head chunks of 1 and recompute)
and 4 processes (dp=2 x cp=2, then cp=4). Every run
trains the same global batch for two optimizer steps with a loss that needs the full `[R]` of each pack
(per-sequence means, an entropy term); the tests compare the per-token log-probs (`compute_log_prob`), the
reported loss/metrics (counted once, not cp times) and the parameters after each step with the reference, and
check that CP peers hold identical parameters.

Packs: sequence lengths not divisible by 2*cp (alignment pads), long enough to straddle zig-zag chunk borders;
pack 0 is laid out by `pad_for_cp(..., pad_multiple=24)` (a trailing pad slot), pack 1 is a plain pack the
backend re-lays out itself.
"""

from __future__ import annotations

import os

import pytest
import torch
from dist_utils import free_port, spawn

from rlbench.packing import pack_samples, pad_for_cp
from rlbench.types import Sample

LR = 0.1
EPS = 1.0  # AdamW update ~ LR * g / EPS: linear in the gradient (eps=1e-8 turns fp noise in ~0 grads into +-LR)
PAD_ID = 3
LENGTHS = [7, 13, 5, 11, 9, 17, 10, 6]
CHUNKED = {"cp_kv_head_chunk": 1, "cp_recompute": True}  # the tiny model has 2 KV heads: one per all-gather
RUNS = {1: [(1, 1)], 2: [(1, 2), (1, 2, "chunked")], 4: [(2, 2), (1, 4)]}  # world -> [(dp, cp[, variant])]


def make_samples() -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i, n in enumerate(LENGTHS):
        tokens = torch.randint(0, 128, (n,), generator=g).tolist()
        resp = int(torch.randint(2, n - 1, (1,), generator=g))
        mask = [float(x) for x in (torch.rand(resp, generator=g) > 0.2)]
        out.append(Sample(tokens=tokens, response_length=resp, loss_mask=mask,
                          advantage=float(torch.randn(1, generator=g)), index=i))
    return out


def make_packs(samples, dp: int, dp_rank: int, cp: int) -> list:
    mine = list(range(dp_rank, len(samples), dp))
    first = pack_samples(samples, mine[0::2], pad_token_id=PAD_ID)
    first = pad_for_cp(first, cp, pad_multiple=24) if cp > 1 else first
    second = pack_samples(samples, mine[1::2], pad_multiple=4, pad_token_id=PAD_ID)  # unaligned: backend re-pads
    return [first, second]


def loss_inputs(samples, pack) -> dict:
    n_tokens = sum(sum(s.loss_mask) for s in samples)
    ids = pack.sample_ids
    mask = torch.cat([torch.tensor(samples[i].loss_mask, dtype=torch.float32) for i in ids])
    adv = torch.cat([torch.full((samples[i].response_length,), samples[i].advantage) for i in ids])
    seg = torch.repeat_interleave(torch.arange(len(ids)), torch.tensor(pack.response_lengths))
    return {"w": mask / n_tokens, "mask": mask, "adv": adv, "seg": seg,
            "seq_w": torch.full((len(ids),), 1.0 / len(samples))}


def full_response_loss(logp, ent, inputs):
    """REINFORCE + an entropy bonus + a per-sequence-mean term (needs every token of each sequence)."""
    pg = -(inputs["w"] * inputs["adv"] * logp).sum()
    n = inputs["seq_w"].numel()
    seq_sum = logp.new_zeros(n).index_add(0, inputs["seg"], logp * inputs["mask"])
    seq_len = logp.new_zeros(n).index_add(0, inputs["seg"], inputs["mask"]).clamp_min(1)
    seq_term = (inputs["seq_w"] * (seq_sum / seq_len) ** 2).sum()
    ent_term = (inputs["w"] * ent).sum()
    loss = pg + 0.1 * seq_term - 0.01 * ent_term
    return loss, {"pg_loss": pg.detach(), "seq_term": seq_term.detach(), "entropy": ent_term.detach()}


def _per_sample(packs, outs) -> dict[int, torch.Tensor]:
    res = {}
    for pack, out in zip(packs, outs):
        for sid, v in zip(pack.sample_ids, torch.split(out.log_probs, pack.response_lengths)):
            res[sid] = v.clone()
    return res


def _snapshot(backend) -> dict[str, torch.Tensor]:
    return {n: t.clone() for b in backend.named_weights_for_sync(1 << 20, torch.float32) for n, t in b}


def _worker(rank: int, world: int, port: int, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK="0")
    torch.set_num_threads(1)
    import torch.distributed as dist

    from rlbench.backends.fsdp.actor import FSDPBackend
    from rlbench.configs.backend import FSDPOptions, OptimConfig, TrainConfig
    from rlbench.distributed import init_distributed

    samples = make_samples()
    res: dict = {}
    for run in RUNS[world]:
        dp, cp = run[:2]
        env = init_distributed("cpu", cp_size=cp)
        assert env.dp_size == dp
        cfg = TrainConfig(model="tiny", device="cpu", param_dtype="fp32", cp_size=cp, with_entropy=True, optim=OptimConfig(lr=LR, eps=EPS, clip_grad=100.0), fsdp=FSDPOptions(**(CHUNKED if "chunked" in run else {})))
        b = FSDPBackend(cfg, env=env, loss_fn=full_response_loss)
        b.init()
        packs = make_packs(samples, dp, env.dp_rank, cp)
        inputs = [loss_inputs(samples, p) for p in packs]
        out = {"dp_rank": env.dp_rank, "cp_rank": env.cp_rank,
               "logp0": _per_sample(packs, b.compute_log_prob(packs)),
               "ent0": [o.entropy for o in b.compute_log_prob(packs, with_entropy=True)]}
        out["step1"] = b.train(packs, inputs)
        out["params1"] = _snapshot(b)
        out["logp1"] = _per_sample(packs, b.compute_log_prob(packs))
        out["step2"] = b.train(packs, inputs)
        out["params2"] = _snapshot(b)
        out["local2"] = {n: p.to_local().clone() for n, p in b.model.named_parameters()}
        res[run] = out
    if world == 2:
        bad = TrainConfig(model="tiny", device="cpu", cp_size=2, fsdp=FSDPOptions(cp_kv_head_chunk=3))
        res["bad_chunk_error"] = _value_error(lambda: FSDPBackend(bad, env=env).init())
        # the last run's backend, asked for 1 pack on rank 0 and 2 on rank 1: an error on both, not a hang
        res["count_error"] = _value_error(lambda: b.compute_log_prob(packs[: 1 + rank]))
    torch.save(res, os.path.join(root, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _value_error(fn) -> str:
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = {}
    for world, runs in RUNS.items():
        root = str(tmp_path_factory.mktemp(f"world{world}"))
        spawn(_worker, args=(world, free_port(), root), nprocs=world)
        ranks = [torch.load(os.path.join(root, f"rank{r}.pt")) for r in range(world)]
        for run in runs:
            out[run] = [r[run] for r in ranks]
        out.update({k: [r[k] for r in ranks] for k in ranks[0] if isinstance(k, str)})
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


CASES = [(1, 2), (1, 2, "chunked"), (2, 2), (1, 4)]


@pytest.mark.parametrize("run", CASES)
def test_log_probs_match_cp1(results, run):
    ref = results[(1, 1)][0]
    dp = run[0]
    for r in results[run]:
        for key in ("logp0", "logp1"):
            got = r[key]
            assert set(got) == {i for i in range(len(LENGTHS)) if i % dp == r["dp_rank"]}
            for sid, v in got.items():
                assert v.shape == ref[key][sid].shape
                assert rel(v, ref[key][sid]) <= 1e-6, (key, sid)
        assert all(e is not None and torch.isfinite(e).all() for e in r["ent0"])


@pytest.mark.parametrize("run", CASES)
def test_loss_and_metrics_match_cp1_counted_once(results, run):
    ref = results[(1, 1)][0]
    for r in results[run]:
        for step in ("step1", "step2"):
            for k in ("train/loss", "train/pg_loss", "train/seq_term", "train/entropy", "train/grad_norm"):
                assert abs(r[step][k] - ref[step][k]) <= 1e-6 * abs(ref[step][k]), (step, k, r[step][k], ref[step][k])
            assert r[step]["train/skipped"] == 0.0


@pytest.mark.parametrize("run", CASES)
def test_params_match_cp1_and_cp_peers_agree(results, run):
    ref = results[(1, 1)][0]
    ranks = results[run]
    for r in ranks:
        for key in ("params1", "params2"):
            assert r[key].keys() == ref[key].keys()
            assert r[key]["model.embed_tokens.weight"].shape == ref[key]["model.embed_tokens.weight"].shape
            worst = max(rel(r[key][n], ref[key][n]) for n in ref[key])
            assert worst <= 1e-5, (key, worst)
        assert all(torch.equal(r["params2"][n], ranks[0]["params2"][n]) for n in ref["params2"])


def test_config_rejects_cp_with_batch_invariant_or_flash():
    from rlbench.configs.backend import FSDPOptions, TrainConfig

    with pytest.raises(ValueError, match="batch_invariant"):
        TrainConfig(device="cpu", cp_size=2, batch_invariant=True)
    with pytest.raises(ValueError, match="flash_attention_2"):
        TrainConfig(device="cuda", cp_size=2, fsdp=FSDPOptions(attn_implementation="flash_attention_2"))


def test_kv_head_chunks_and_recompute_change_only_the_schedule(results):
    plain, chunked = results[(1, 2)], results[(1, 2, "chunked")]
    for a, b in zip(plain, chunked):
        for key in ("logp0", "logp1"):
            assert all(torch.equal(a[key][sid], b[key][sid]) for sid in a[key]), key
        for step in ("step1", "step2"):
            assert a[step]["train/loss"] == b[step]["train/loss"]
            assert a[step]["train/grad_norm"] == b[step]["train/grad_norm"]
        assert all(torch.equal(a["params2"][n], b["params2"][n]) for n in a["params2"])


def test_kv_head_chunk_is_validated():
    from rlbench.configs.backend import FSDPOptions, TrainConfig

    with pytest.raises(ValueError, match="cp_kv_head_chunk=0 must be >= 1"):
        TrainConfig(device="cpu", cp_size=2, fsdp=FSDPOptions(cp_kv_head_chunk=0))
    with pytest.warns(UserWarning, match="no effect with cp_size=1"):
        TrainConfig(device="cpu", fsdp=FSDPOptions(cp_recompute=True))


def test_kv_head_chunk_must_divide_the_kv_heads(results):
    for error in results["bad_chunk_error"]:
        assert "cp_kv_head_chunk=3 does not divide the model's 2 KV heads" in error


def test_unequal_micro_batch_counts_fail_before_any_collective(results):
    for error in results["count_error"]:
        assert "ranks have different micro-batch counts (min 1, max 2)" in error


def test_cli_flags_set_the_cp_attention_fields():
    from rlbench.cli import build_parser, preset_config

    argv = ["train", "--backend", "ray", "--actor-num-gpus-per-node", "2", "--context-parallel-size", "2",
            "--cp-kv-head-chunk", "1", "--cp-recompute"]
    args = build_parser().parse_args(argv)
    cfg = preset_config(args)
    assert (cfg.backend.cp_size, cfg.backend.fsdp.cp_kv_head_chunk, cfg.backend.fsdp.cp_recompute) == (2, 1, True)
