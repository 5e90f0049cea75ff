"""The split-KV Triton decode attention (`rlbench/engine/split_kv.py`): on the CPU under Triton's interpreter
(tests/split_kv_check.py in a subprocess, 32-key chunks) against float64 and through the engine's grouped layout
against SDPA; on CUDA compiled and eager against float64 at the product's chunk size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

HERE = Path(__file__).resolve().parent


def test_interpreted_split_kv_equals_float64_and_the_sdpa_engine():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(HERE / "split_kv_check.py")], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for case, err in result["kernel"].items():  # bf16: the output's rounding (the interpreter truncates: 2 ulp)
        assert err < (2e-6 if "float32" in case else 1.6e-2), (case, err)
    assert result["engine"]["same_tokens"]
    assert result["engine"]["max_logprob_diff"] < 2e-6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_split_kv_on_cuda_eager_and_compiled():
    """The product's CHUNK on CUDA: eager and inside torch.compile (dynamic shapes, as the engine compiles)."""
    sys.path.insert(0, str(HERE))
    import split_kv_check

    from rlbench.engine.attention import group_decode_mask
    from rlbench.engine.split_kv import split_kv_decode

    errs = split_kv_check.kernel_errors("cuda")
    for case, err in errs.items():
        assert err < (1e-5 if "float32" in case else 1.6e-2), (case, err)
    g, k, heads, n_kv, hd = 8, 8, 2, 8, 128
    compiled = torch.compile(split_kv_decode, dynamic=True)
    for length in (640, 2560):
        keys = torch.randn(g, n_kv, length, hd, device="cuda", dtype=torch.bfloat16)
        values = torch.randn_like(keys)
        prefix = torch.full((g * k,), 510, device="cuda")
        _, mask = group_decode_mask(prefix + (length - 510) // k - 1, prefix, k, heads, length)
        q = torch.randn(g, n_kv, k * heads, hd, device="cuda", dtype=torch.bfloat16)
        want = split_kv_check.reference(q, keys, values, mask, hd**-0.5)
        assert (compiled(q, keys, values, mask, hd**-0.5).double() - want).abs().max() < 1.6e-2
        assert (split_kv_decode(q, keys, values, mask, hd**-0.5).double() - want).abs().max() < 1.6e-2
