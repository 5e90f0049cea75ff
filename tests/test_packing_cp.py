"""Context-parallel padding, zig-zag / contiguous slicing and the inverse gather (rlbench.packing.cp)."""

import random

import pytest
import torch

from rlbench.packing import (
    cp_gather,
    cp_layout,
    cp_local_response,
    cp_slice,
    pack_samples,
    pad_for_cp,
    round_up,
)
from rlbench.types import Sample


def _random_pack(rng, n_max=6, len_max=30):
    samples = []
    for _ in range(rng.randint(1, n_max)):
        prompt, resp = rng.randint(1, len_max // 2), rng.randint(0, len_max // 2)
        samples.append(Sample(tokens=[rng.randint(0, 50) for _ in range(prompt + resp)], response_length=resp))
    return pack_samples(samples, pad_multiple=rng.choice([1, 3])), samples


def test_zigzag_hand_example():
    # one 8-token sequence, cp=2: chunks of 2 -> rank 0 gets chunks 0 and 3, rank 1 chunks 1 and 2
    p = pad_for_cp(pack_samples([list(range(10, 18))]), 2)
    layout = cp_layout(p, 2)
    assert layout.indices[0].tolist() == [0, 1, 6, 7] and layout.indices[1].tolist() == [2, 3, 4, 5]
    assert cp_slice(p.tokens, layout, 1).tolist() == [12, 13, 14, 15]
    assert cp_slice(p.position_ids, layout, 0).tolist() == [0, 1, 6, 7]  # per-rank positions
    # a 3-token and a 5-token sequence: slots padded to 4 and 8 (alignment after the real tokens)
    p = pad_for_cp(pack_samples([[1, 2, 3], [4, 5, 6, 7, 8]]), 2)
    assert p.cu_seqlens.tolist() == [0, 4, 12] and p.seq_lengths.tolist() == [3, 5] and p.pad_length == 0
    layout = cp_layout(p, 2)
    assert layout.indices[0].tolist() == [0, 3, 4, 5, 10, 11]
    assert [c.tolist() for c in layout.local_cu_seqlens] == [[0, 2, 6], [0, 2, 6]]


def test_contiguous_hand_example():
    p = pad_for_cp(pack_samples([[1, 2, 3], [4, 5, 6, 7, 8]]), 3, zigzag=False)
    assert p.num_tokens == 9 and p.pad_length == 1 and p.cu_seqlens.tolist() == [0, 3, 8]
    layout = cp_layout(p, 3, zigzag=False)
    assert [i.tolist() for i in layout.indices] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert layout.local_cu_seqlens[1].tolist() == [0, 0, 3, 3]  # global slots [0,3) [3,8) [8,9)


@pytest.mark.parametrize("zigzag", [True, False])
def test_slice_gather_identity_random(zigzag):
    rng = random.Random(0 if zigzag else 1)
    for _ in range(400):
        pack, samples = _random_pack(rng)
        cp = rng.choice([1, 2, 3, 4])
        p = pad_for_cp(pack, cp, zigzag=zigzag)
        layout = cp_layout(p, cp, zigzag=zigzag)
        T = p.num_tokens
        # padding only what alignment requires; real sequences unchanged
        assert torch.equal(p.seq_lengths, pack.seq_lengths)
        if zigzag:
            assert bool((p.seq_pads < 2 * cp).all()) and p.pad_length == 0 and T % (2 * cp) == 0
        else:
            assert bool((p.seq_pads == 0).all()) and p.pad_length < cp and T % cp == 0
            assert T == round_up(p.num_real_tokens, cp)
        # every position on exactly one rank, same count per rank
        assert sorted(torch.cat(layout.indices).tolist()) == list(range(T))
        assert {len(i) for i in layout.indices} == {T // cp}
        x = torch.randn(T, 3, dtype=torch.float64)
        assert torch.equal(cp_gather([cp_slice(x, layout, r) for r in range(cp)], layout), x)
        assert torch.equal(cp_gather([cp_slice(p.tokens, layout, r) for r in range(cp)], layout), p.tokens)
        cu = layout.cu_seqlens.long()
        for r in range(cp):
            local_cu = layout.local_cu_seqlens[r].long()
            if zigzag:  # each rank holds 1/cp of every slot: local boundaries are the global ones / cp
                assert torch.equal(local_cu, cu // cp)
            assert int(local_cu[-1]) == T // cp
        _check_local_response(p, layout, cp)


def _check_local_response(p, layout, cp):
    covered = []
    for r in range(cp):
        local_pos, resp_ids = cp_local_response(p, layout, r)
        glob = layout.indices[r][local_pos]
        assert torch.equal(glob, p.response_index[resp_ids])
        covered += resp_ids.tolist()
    assert sorted(covered) == list(range(len(p.response_index)))


def test_zigzag_balances_causal_work_per_rank():
    """Causal attention work of rank r = sum over its tokens of (position + 1). Zig-zag keeps it equal
    across ranks for every sequence; contiguous slicing does not."""
    pack = pack_samples([list(range(64)), list(range(32))])
    for zigzag, tol in [(True, 0.0), (False, None)]:
        p = pad_for_cp(pack, 4, zigzag=zigzag)
        layout = cp_layout(p, 4, zigzag=zigzag)
        work = [float((cp_slice(p.position_ids, layout, r) + 1).sum()) for r in range(4)]
        spread = max(work) / min(work) - 1
        if tol is not None:
            assert spread == tol
        else:
            assert spread > 1.0


def test_gather_is_autograd_aware_and_errors():
    p = pad_for_cp(pack_samples([[1, 2, 3, 4, 5]]), 2)
    layout = cp_layout(p, 2)
    parts = [torch.randn(len(i), requires_grad=True) for i in layout.indices]
    weights = torch.arange(p.num_tokens, dtype=torch.float32)
    (cp_gather(parts, layout) * weights).sum().backward()
    for part, idx in zip(parts, layout.indices):
        assert torch.equal(part.grad, weights[idx])
    with pytest.raises(ValueError, match="pad_for_cp"):
        cp_layout(pack_samples([[1, 2, 3]]), 2)
