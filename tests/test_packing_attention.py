"""Packed sequences must not attend to each other, with every attention backend TrainConfig allows: logits of a
packed `[1, T]` forward (position_ids restarting per sequence, use_cache=False) equal the logits of each
sequence run alone, and the same pack with one running position range (the negative control) does leak.

CPU: sdpa, eager, flex_attention (forward only: flex has no CPU backward; transformers builds its BlockMask
from the position ids). GPU (`pytest -m gpu`): the same three plus flash_attention_2 when flash_attn is installed.
"""

import pytest
import torch

from rlbench.configs.backend import ATTN_IMPLEMENTATIONS
from rlbench.models import build_model
from rlbench.packing import pack_samples, pad_for_cp, unpack_tokens

LENGTHS = (5, 9, 3, 12)
CPU_BACKENDS = ("sdpa", "eager", "flex_attention")


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


def _leaky(pack):
    """The same pack with one running position range: every sequence sees the ones before it."""
    pack.position_ids = torch.arange(pack.num_tokens)
    return pack


def test_every_allowed_backend_is_covered():
    gpu_only = {"flash_attention_2", "flash_attention_3"}  # flash_attention_3 (Hopper build) is not tested yet
    assert set(ATTN_IMPLEMENTATIONS) == set(CPU_BACKENDS) | gpu_only


@pytest.fixture(scope="module", params=CPU_BACKENDS)
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
    assert _max_diff(tiny, _leaky(pack_samples(seqs, pad_multiple=8)), seqs) > 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("impl", ["sdpa", "eager", "flex_attention", "flash_attention_2"])
def test_packed_separation_on_gpu(impl):
    # flash-attn kernels take only fp16/bf16: bf16 weights, where packed vs alone differ by rounding (~1e-2 on CPU
    # sdpa bf16) while a leak moves logits by ~1.5 (small preset, CPU sdpa measurement).
    dtype, tol = (torch.float32, 1e-4)
    if impl == "flash_attention_2":
        pytest.importorskip("flash_attn")
        dtype, tol = (torch.bfloat16, 5e-2)
    model = build_model("small", device="cuda", dtype=dtype, attn_implementation=impl).eval()
    seqs = _sequences()
    assert _max_diff(model, pack_samples(seqs, pad_multiple=8), seqs, device="cuda") < tol
    assert _max_diff(model, pad_for_cp(pack_samples(seqs), 2), seqs, device="cuda") < tol
    assert _max_diff(model, _leaky(pack_samples(seqs, pad_multiple=8)), seqs, device="cuda") > 0.5
