"""Fixtures shared by several test files."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """Run the test with one torch thread (small-op tests are faster, and the 2-core CI box is shared)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def no_tf32():
    """Plain fp32 matmuls (no TF32) for the test: GPU checks against float64 references need IEEE fp32."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old
