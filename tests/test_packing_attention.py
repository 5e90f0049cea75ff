"""Packed sequences must not attend to each other: logits of a packed `[1, T]` forward (position_ids
restarting per sequence, use_cache=False) equal the logits of each sequence run alone."""

import pytest
import torch

from rlbench.models import build_model
from rlbench.packing import pack_samples, pad_for_cp, unpack_tokens

LENGTHS = (5, 9, 3, 12)


def _sequences(vocab=128):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def _max_diff(model, pack, seqs, device="cpu"):
    with torch.no_grad():
        packed = model(input_ids=pack.tokens[None].to(device), position_ids=pack.position_ids[None].to(device),
                       use_cache=False).logits[0].float().cpu()
        alone = [model(input_ids=torch.tensor(s, device=device)[None], use_cache=False).logits[0].float().cpu()
                 for s in seqs]
    return max((a - b).abs().max().item() for a, b in zip(unpack_tokens(pack, packed), alone))


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def tiny(request):
    torch.manual_seed(0)
    return build_model("tiny", attn_implementation=request.param).eval()


def test_packed_logits_equal_per_sequence_logits(tiny):
    seqs = _sequences()
    assert _max_diff(tiny, pack_samples(seqs, pad_multiple=8), seqs) < 1e-5
    # zig-zag CP layout: alignment pads after each sequence, still no leakage into real tokens
    assert _max_diff(tiny, pad_for_cp(pack_samples(seqs), 2), seqs) < 1e-5


def test_without_position_resets_sequences_leak(tiny):
    """Negative control: the same pack with one running position range does mix sequences."""
    seqs = _sequences()
    pack = pack_samples(seqs)
    pack.position_ids = torch.arange(pack.num_tokens)
    assert _max_diff(tiny, pack, seqs) > 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("impl", ["sdpa", "flex_attention", "eager"])
def test_packed_separation_on_gpu(impl):
    model = build_model("small", device="cuda", attn_implementation=impl).eval()
    seqs = _sequences()
    assert _max_diff(model, pack_samples(seqs, pad_multiple=8), seqs, device="cuda") < 1e-4
