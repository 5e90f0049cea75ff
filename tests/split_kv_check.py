"""Checks of the split-KV Triton decode attention (`rlbench/engine/split_kv.py`) shared by tests/test_split_kv.py's
CPU test (this file run with TRITON_INTERPRET=1 set before Triton is imported, so in a subprocess: it prints one
JSON line) and its GPU test (imported).
"""

from __future__ import annotations

import json

import torch

from rlbench.engine import SamplingParams, TorchEngine, TorchEngineConfig, split_kv
from rlbench.engine.attention import decode_mask, group_decode_mask
from rlbench.engine.split_kv import split_kv_decode
from rlbench.models import build_model


def reference(q, keys, values, mask, scale):
    """Float64 masked softmax attention: q `[B, n_kv, M, hd]`, mask `[B, 1, 1 or M, L]`."""
    s = torch.einsum("bhmd,bhld->bhml", q.double(), keys.double()) * scale
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1)
    return torch.einsum("bhml,bhld->bhmd", p, values.double())


def kernel_errors(device: str = "cpu") -> dict[str, float]:
    """Max |split_kv - float64| per case: grouped rows whose visible keys end inside, at and past a chunk edge
    (a chunk with no visible key for some rows), the slot layout at positions 0 and at chunk edges, and a key
    window that is a strided slice of a longer cache, in fp32 and bf16."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        def randn(*shape, dtype=dtype):
            return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

        chunk = split_kv.CHUNK
        rows, k, heads, n_kv, hd, length = 3, 4, 2, 2, 32, chunk + 96
        cache_k, cache_v = randn(rows + 1, n_kv, 2 * length, hd), randn(rows + 1, n_kv, 2 * length, hd)
        keys, values = cache_k[:rows, :, :length], cache_v[:rows, :, :length]
        prefix = torch.tensor([7] * k + [chunk - 3] * k + [chunk + 20] * k, device=device)
        positions = prefix + torch.tensor([0] * k + [1] * k + [18] * k, device=device)
        _, mask = group_decode_mask(positions, prefix, k, heads, length)
        q = randn(rows, n_kv, k * heads, hd)
        got = split_kv_decode(q, keys, values, mask, hd**-0.5)
        out[f"grouped/{dtype}"] = (got.double() - reference(q, keys, values, mask, hd**-0.5)).abs().max().item()

        b = 5
        pos = torch.tensor([0, 3, chunk - 1, chunk, length - 1], device=device)
        mask1 = decode_mask(pos, length)
        q1, keys1, values1 = randn(b, n_kv, heads, hd), randn(b, n_kv, length, hd), randn(b, n_kv, length, hd)
        got = split_kv_decode(q1, keys1, values1, mask1, 0.3)
        out[f"slot/{dtype}"] = (got.double() - reference(q1, keys1, values1, mask1, 0.3)).abs().max().item()
    return out


def engine_outputs(decode_attention: str, shared_prefix: bool, device: str = "cpu") -> list:
    """Tokens and log-probs of n = 3 samples of 4 prompts through 6 slots (group rows reused mid-run), the tiny
    model in fp32, with the given decode attention. Prompts of 1 to 70 tokens: with the CPU test's 32-key
    chunks the windows cross chunk edges."""
    cfg = TorchEngineConfig(max_seq_len=96, num_slots=6, steps_per_sync=4, shared_prefix=shared_prefix,
                            decode_attention=decode_attention, compile=False, cuda_graphs=False)
    engine = TorchEngine(build_model("tiny", seed=0).to(device), cfg)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (4, 40, 1, 70)]
    got = engine.generate(prompts, SamplingParams(temperature=0.9, max_new_tokens=8, n=3, seed=11))
    return [(s.token_ids, s.log_probs) for s in got]


if __name__ == "__main__":
    split_kv.CHUNK = 32  # chunk edges at interpreter-sized lengths (the kernel takes CHUNK as a constexpr)
    result = {"kernel": kernel_errors()}
    want, got = engine_outputs("sdpa", True), engine_outputs("split_kv", True)
    result["engine"] = {
        "same_tokens": [w[0] for w in want] == [x[0] for x in got],
        "max_logprob_diff": max(abs(a - b) for w, x in zip(want, got) for a, b in zip(w[1], x[1])),
    }
    print(json.dumps(result))
