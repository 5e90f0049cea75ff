"""True on-policy mode through the FSDP2 backend on 2 gloo ranks: each rank's packed recompute of its share of
the engine's samples equals the engine's log-probs bit for bit (fp32 and bf16 mixed precision)."""

from __future__ import annotations

import os

import pytest
import torch
from dist_utils import free_port, spawn

from rlbench.engine import SamplingParams, TorchEngine, TorchEngineConfig
from rlbench.models import build_model, load_model, save_pretrained
from rlbench.packing.pack import pack_samples
from rlbench.types import Sample

WORLD = 2
TEMPERATURE = 0.8
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _samples(gens, prompts) -> list[Sample]:
    return [Sample(tokens=prompts[g.prompt_index] + g.token_ids, response_length=len(g.token_ids), index=i)
            for i, g in enumerate(gens)]


def _worker(rank: int, root: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK="0")
    torch.set_num_threads(1)
    import torch.distributed as dist

    from rlbench.backends.fsdp.actor import FSDPBackend
    from rlbench.configs.backend import TrainConfig
    from rlbench.distributed.mesh import init_distributed

    env = init_distributed("cpu")
    out = {}
    for name in DTYPES:
        data = torch.load(os.path.join(root, f"gens_{name}.pt"), weights_only=False)
        samples = data["samples"]
        backend = FSDPBackend(TrainConfig(model=os.path.join(root, "hf"), device="cpu", param_dtype=name, batch_invariant=True), env=env, temperature=TEMPERATURE)
        backend.init()
        mine = list(range(rank, len(samples), WORLD))
        packs = [pack_samples(samples, mine[k::2], pad_multiple=8) for k in range(2)]  # 2 micro-batches
        outs = backend.compute_log_prob(packs)
        out[name] = {s: lp for p, o in zip(packs, outs) for s, lp in zip(p.sample_ids, o.per_sample())}
    torch.save(out, os.path.join(root, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("top"))
    model = build_model("tiny", seed=3)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4)  # logits far from uniform: rounding differences show
    save_pretrained(model, None, os.path.join(root, "hf"))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (4, 11, 7, 15, 2)]
    engines = {}
    for name, dtype in DTYPES.items():
        engine = TorchEngine(load_model(os.path.join(root, "hf"), dtype=dtype),
                             TorchEngineConfig(max_seq_len=64, num_slots=4, batch_invariant=True))
        gens = engine.generate(prompts, SamplingParams(temperature=TEMPERATURE, max_new_tokens=16, n=2, seed=1))
        torch.save({"samples": _samples(gens, prompts)}, os.path.join(root, f"gens_{name}.pt"))
        engines[name] = gens
    spawn(_worker, args=(root, free_port()), nprocs=WORLD)
    ranks = [torch.load(os.path.join(root, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]
    return engines, ranks


@pytest.mark.parametrize("name", list(DTYPES))
def test_two_rank_recompute_equals_engine_bitwise(runs, name):
    engines, ranks = runs
    gens = engines[name]
    recomputed = {i: lp for r in ranks for i, lp in r[name].items()}
    assert sorted(recomputed) == list(range(len(gens)))
    for i, gen in enumerate(gens):
        rollout = torch.tensor(gen.log_probs, dtype=torch.float32)
        assert torch.equal(rollout, recomputed[i].float()), f"{name} sample {i}: max |diff| " \
                                                              f"{(rollout - recomputed[i].float()).abs().max():.3e}"
