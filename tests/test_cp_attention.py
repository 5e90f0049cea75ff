"""CP attention (rlbench.distributed.cp_attention) over gloo: cp=2 and cp=4 ranks, each on its zig-zag slice of a
packed batch, reproduce one process's full-pack forward (logits) and backward (parameter gradients).

One `torch.multiprocessing.spawn` per world size (2: cp=2; 4: cp=4 and dp=2 x cp=2); the workers save their
results, the tests compare them with a plain single-process HF (sdpa) reference built from the same seed.
"""

from __future__ import annotations

import os

import pytest
import torch
from dist_utils import free_port, spawn

from rlbench.distributed.cp_attention import CPAttnInfo, cp_attention_info, cp_block_tables, cp_dense_mask
from rlbench.models import build_model
from rlbench.packing import cp_layout, pack_samples, pad_for_cp
from rlbench.types import Sample

# lengths not divisible by 2*cp (alignment pad slots) and long enough to straddle zig-zag chunk borders;
# pad_multiple=24 adds a trailing pad slot at cp=2 (56 -> 72) and cp=4 (64 -> 72)
LENGTHS = {"a": [7, 13, 5, 11, 9], "b": [10, 3, 14, 6]}
PAD_MULTIPLE = 24
PAD_ID = 5
WORLDS = (2, 4)
CONFIGS = {"all_heads": dict(kv_head_chunk=None, recompute=False), "chunk1_recompute": dict(kv_head_chunk=1, recompute=True)}


def make_samples(name: str) -> list[Sample]:
    g = torch.Generator().manual_seed(len(name) + sum(LENGTHS[name]))
    out = []
    for n in LENGTHS[name]:
        tokens = torch.randint(0, 128, (n,), generator=g).tolist()
        out.append(Sample(tokens=tokens, response_length=n - 2))
    return out


def make_pack(name: str, cp: int):
    return pad_for_cp(pack_samples(make_samples(name), pad_token_id=PAD_ID), cp, pad_multiple=PAD_MULTIPLE)


def loss_weights(pack) -> torch.Tensor:
    return torch.randn(pack.response_index.numel(), generator=torch.Generator().manual_seed(7))  # [R]


def real_positions(pack) -> torch.Tensor:
    """[T] bool from the pack's explicit slot boundaries and lengths (never from token values)."""
    real = torch.zeros(pack.num_tokens, dtype=torch.bool)
    for start, n in zip(pack.cu_seqlens[:-1].tolist(), pack.seq_lengths.tolist()):
        real[start : start + n] = True
    return real


def _run_cp(model, pack, env, cfg: dict, rank_info: CPAttnInfo, layout, cp_rank: int, group, with_grad: bool):
    """Local forward (+ backward of this rank's part of the loss): (full logits [T, V], param grads summed over CP)."""
    import torch.distributed as dist

    from rlbench.distributed.cp_attention import CPContext
    from rlbench.packing import cp_gather, cp_local_response, cp_slice

    ctx = CPContext(rank_info, group, **cfg)
    tokens, positions = cp_slice(pack.tokens, layout, cp_rank), cp_slice(pack.position_ids, layout, cp_rank)
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(with_grad):
        logits = model(input_ids=tokens[None], position_ids=positions[None], rl_cp=ctx, use_cache=False).logits[0]
    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, logits.detach().contiguous(), group=group)
    full = cp_gather(parts, layout)
    if not with_grad:
        return full, None
    local_pos, resp_ids = cp_local_response(pack, layout, cp_rank)
    targets = pack.tokens[layout.indices[cp_rank][local_pos] + 1]
    logp = torch.log_softmax(logits[local_pos], -1).gather(-1, targets[:, None])[:, 0]
    (loss_weights(pack)[resp_ids] * logp).sum().backward()
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g, group=group)  # the reduction across CP peers slime forgot
        grads[n] = g
    return full, grads


def _worker(rank: int, world: int, port: int, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK="0")
    torch.set_num_threads(1)
    import torch.distributed as dist

    from rlbench.distributed import init_distributed
    from rlbench.distributed.cp_attention import CP_ATTN_NAME

    model = build_model("tiny", dtype=torch.float32, seed=0)
    model.config._attn_implementation = CP_ATTN_NAME
    res: dict = {}
    meshes = [(world, "a")] if world == 2 else [(4, "a"), (2, None)]  # (cp, pack name; None: pack by dp rank)
    for cp, name in meshes:
        env = init_distributed("cpu", cp_size=cp)
        group = env.mesh["cp"].get_group()
        name = name or ["a", "b"][env.dp_rank]
        pack = make_pack(name, cp)
        layout = cp_layout(pack, cp)
        info = cp_attention_info(layout, env.cp_rank)
        for label, cfg in CONFIGS.items():
            full, grads = _run_cp(model, pack, env, cfg, info, layout, env.cp_rank, group, with_grad=True)
            res[(cp, env.dp_size, name, label)] = {"logits": full, "grads": grads}
        # padding never influences real tokens: other pad ids, same real logits
        changed = pack.tokens.clone()
        pad = ~real_positions(pack)
        changed[pad] = torch.randint(0, 128, (int(pad.sum()),), generator=torch.Generator().manual_seed(3))
        pack.tokens = changed
        full, _ = _run_cp(model, pack, env, CONFIGS["all_heads"], info, layout, env.cp_rank, group, with_grad=False)
        res[(cp, env.dp_size, name, "pads_changed")] = {"logits": full, "num_pad": int(pad.sum())}
    torch.save(res, os.path.join(root, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = {}
    for world in WORLDS:
        root = str(tmp_path_factory.mktemp(f"cp{world}"))
        spawn(_worker, args=(world, free_port(), root), nprocs=world)
        out[world] = [torch.load(os.path.join(root, f"rank{r}.pt")) for r in range(world)]
    return out


def reference(name: str, cp: int) -> tuple[torch.Tensor, dict]:
    """One process, plain HF sdpa over the whole (cp-padded) pack: logits [T, V] and the loss's gradients."""
    pack = make_pack(name, cp)
    model = build_model("tiny", dtype=torch.float32, seed=0)
    logits = model(input_ids=pack.tokens[None], position_ids=pack.position_ids[None], use_cache=False).logits[0]
    idx = pack.response_index
    logp = torch.log_softmax(logits[idx], -1).gather(-1, pack.tokens[idx + 1][:, None])[:, 0]
    (loss_weights(pack) * logp).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


CASES = [(2, 2, 1, "a"), (4, 4, 1, "a"), (4, 2, 2, "a"), (4, 2, 2, "b")]  # (world, cp, dp, pack)


@pytest.mark.parametrize("label", list(CONFIGS))
@pytest.mark.parametrize("world,cp,dp,name", CASES)
def test_cp_logits_and_grads_match_one_process(results, world, cp, dp, name, label):
    ref_logits, ref_grads = reference(name, cp)
    ranks = [r for r in results[world] if (cp, dp, name, label) in r]
    assert len(ranks) == cp  # every CP peer of the group that ran this pack
    for r in ranks:
        got = r[(cp, dp, name, label)]
        assert got["logits"].shape == ref_logits.shape
        assert rel(got["logits"], ref_logits) <= 1e-6
        assert got["grads"].keys() == ref_grads.keys()
        worst = max(rel(got["grads"][n], ref_grads[n]) for n in ref_grads)
        assert worst <= 1e-5, worst
    # CP peers hold identical reduced gradients (replicas cannot drift)
    for r in ranks[1:]:
        assert all(torch.equal(r[(cp, dp, name, label)]["grads"][n], ranks[0][(cp, dp, name, label)]["grads"][n])
                   for n in ref_grads)


def test_cp_real_logits_equal_the_unpadded_pack(results):
    plain = pack_samples(make_samples("a"))  # no CP padding at all
    model = build_model("tiny", dtype=torch.float32, seed=0)
    with torch.no_grad():
        ref = model(input_ids=plain.tokens[None], position_ids=plain.position_ids[None], use_cache=False).logits[0]
    for world, cp in ((2, 2), (4, 4)):
        pack = make_pack("a", cp)
        got = results[world][0][(cp, 1, "a", "all_heads")]["logits"][real_positions(pack)]
        assert rel(got, ref) <= 1e-6


@pytest.mark.parametrize("world,cp,dp,name", CASES)
def test_pad_tokens_never_influence_real_tokens(results, world, cp, dp, name):
    real = real_positions(make_pack(name, cp))
    for r in results[world]:
        if (cp, dp, name, "pads_changed") not in r:
            continue
        changed = r[(cp, dp, name, "pads_changed")]
        assert changed["num_pad"] > 0
        base = r[(cp, dp, name, "all_heads")]["logits"]
        assert torch.equal(changed["logits"][real], base[real])
        assert not torch.equal(changed["logits"][~real], base[~real])  # the pads did change (the test bites)


def _info(cp: int, rank: int, name: str = "a") -> CPAttnInfo:
    return cp_attention_info(cp_layout(make_pack(name, cp), cp), rank)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_info_and_dense_mask(cp):
    pack = make_pack("a", cp)
    layout = cp_layout(pack, cp)
    T = pack.num_tokens
    docs = torch.repeat_interleave(torch.arange(len(pack.cu_seqlens_with_pad) - 1),
                                   (pack.cu_seqlens_with_pad[1:] - pack.cu_seqlens_with_pad[:-1]).long())
    for r in range(cp):
        info = cp_attention_info(layout, r)
        assert torch.equal(info.doc_ids, docs)
        gathered = torch.cat(layout.indices)  # what the rank-ordered all-gather holds
        assert torch.equal(gathered[info.gather_order], torch.arange(T))
        dense = cp_dense_mask(info)
        q = info.q_positions
        j = torch.arange(T)
        assert torch.equal(dense, (docs[q][:, None] == docs[None]) & (j[None] <= q[:, None]))
        assert bool(dense[torch.arange(len(q)), q].all())  # every query sees itself: no empty softmax row
        assert info.local_tokens * cp == T


def _blocks_to_tokens(table: torch.Tensor, block: int, shape: torch.Size) -> torch.Tensor:
    return table.repeat_interleave(block, 0).repeat_interleave(block, 1)[: shape[0], : shape[1]]


@pytest.mark.parametrize("cp,block", [(2, 4), (4, 4), (4, 8), (2, 128)])
def test_block_tables_cover_the_dense_mask(cp, block):
    skipped_or_full = 0
    for rank in range(cp):
        for name in LENGTHS:
            info = _info(cp, rank, name)
            dense = cp_dense_mask(info)
            partial, full = cp_block_tables(info, block)
            assert not bool((partial & full).any())
            assert bool((_blocks_to_tokens(partial | full, block, dense.shape) | ~dense).all())  # none skipped wrongly
            assert bool((~_blocks_to_tokens(full, block, dense.shape) | dense).all())  # full: every pair allowed
            skipped_or_full += int(full.sum()) + int((~(partial | full)).sum())
    assert skipped_or_full > 0 or block == 128  # small blocks: the tables do save work


@pytest.mark.filterwarnings("ignore::UserWarning")  # eager flex on CPU warns that it is unfused
@pytest.mark.parametrize("cp,block", [(1, 8), (2, 8), (4, 8), (2, 128)])
def test_flex_block_mask_equals_sdpa_dense(cp, block):
    """Eager flex_attention (CPU, forward only) with `cp_block_mask` == SDPA with the dense mask, per rank,
    against the full K/V (what the all-gather hands the rank)."""
    from torch.nn.attention.flex_attention import flex_attention

    from rlbench.distributed.cp_attention import cp_block_mask

    g = torch.Generator().manual_seed(cp)
    for rank in range(cp):
        info = _info(cp, rank)
        k, v = torch.randn(2, 1, 2, info.num_tokens, 16, generator=g)
        q = torch.randn(1, 4, info.local_tokens, 16, generator=g)
        out = flex_attention(q, k, v, block_mask=cp_block_mask(info, block), enable_gqa=True)
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=cp_dense_mask(info), enable_gqa=True)
        assert rel(out, ref) <= 1e-5


def test_argument_errors():
    info = _info(2, 0)
    q = torch.zeros(1, 4, info.local_tokens, 16)
    k = torch.zeros(1, 2, info.local_tokens, 16)
    from rlbench.distributed.cp_attention import cp_attention

    with pytest.raises(ValueError, match="cp=2"):
        cp_attention(q, k, k, info, None)
    one = _info(1, 0)
    q1, k1 = torch.zeros(1, 4, one.local_tokens, 16), torch.zeros(1, 2, one.local_tokens, 16)
    with pytest.raises(ValueError, match="kv_head_chunk"):
        cp_attention(q1, k1, k1, one, None, kv_head_chunk=3)
    with pytest.raises(ValueError, match="tokens"):
        cp_attention(q1[:, :, 1:], k1, k1, one, None)
    # cp=1 without a group: plain document-causal attention, equal to SDPA with the dense mask
    q1, k1, v1 = (torch.randn(1, h, one.local_tokens, 16, generator=torch.Generator().manual_seed(h)) for h in (4, 2, 2))
    out = cp_attention(q1, k1, v1, one, None)
    ref = torch.nn.functional.scaled_dot_product_attention(q1, k1.repeat_interleave(2, 1), v1.repeat_interleave(2, 1),
                                                           attn_mask=cp_dense_mask(one)).transpose(1, 2)
    assert out.shape == (1, one.local_tokens, 4, 16) and rel(out, ref) <= 1e-6
