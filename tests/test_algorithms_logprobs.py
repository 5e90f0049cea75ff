"""token_logprobs: values and gradients vs float64 autograd; memory: only the logits + O(T) are saved."""

import pytest
import torch

from rlbench.algorithms import linear_token_logprobs, token_logprobs

pytestmark = pytest.mark.usefixtures("one_thread")  # small ops; as a module-level call it set the whole session


def _ref(logits, targets, temperature):
    lp = torch.log_softmax(logits.double() / temperature, dim=-1)  # [T, V]
    return lp.gather(1, targets[:, None]).squeeze(1), -(lp.exp() * lp).sum(-1)


@pytest.mark.parametrize("T,V,chunk,temp", [(1, 5, 4, 1.0), (13, 11, 4, 0.7), (37, 50, 8, 1.3), (16, 7, 16, 1.0)])
def test_values_and_grads_match_float64_autograd(T, V, chunk, temp):
    g = torch.Generator().manual_seed(T * V)
    logits = (3 * torch.randn(T, V, generator=g, dtype=torch.float64)).requires_grad_()
    targets = torch.randint(0, V, (T,), generator=g)
    a, b = torch.randn(T, generator=g, dtype=torch.float64), torch.randn(T, generator=g, dtype=torch.float64)
    lp, ent = token_logprobs(logits, targets, temp, chunk_size=chunk)
    (gx,) = torch.autograd.grad((a * lp + b * ent).sum(), logits)
    x2 = logits.detach().clone().requires_grad_()
    rlp, rent = _ref(x2, targets, temp)
    (rg,) = torch.autograd.grad((a * rlp + b * rent).sum(), x2)
    torch.testing.assert_close(lp, rlp, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, rent, rtol=0, atol=1e-12)
    torch.testing.assert_close(gx, rg, rtol=0, atol=1e-12)


def test_gradcheck_logp_and_entropy_separately():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 6, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 6, (9,), generator=g)
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, t, 0.8, chunk_size=4)[0], (x,))
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, t, 0.8, chunk_size=4)[1], (x,))
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, t, 0.8, chunk_size=2, with_entropy=False)[0], (x,))


def test_bf16_logits_fp32_outputs_and_bf16_grad():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(20, 33, generator=g).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, 33, (20,), generator=g)
    lp, ent = token_logprobs(x, t, 0.9, chunk_size=7)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    (lp.sum() + ent.sum()).backward()
    assert x.grad.dtype == torch.bfloat16
    xr = x.detach().double().requires_grad_()
    rlp, rent = _ref(xr, t, 0.9)
    (rlp.sum() + rent.sum()).backward()
    torch.testing.assert_close(lp.double(), rlp, rtol=0, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), xr.grad, rtol=2e-2, atol=2e-2)  # bf16 storage of the grad


def test_saves_only_logits_and_per_row_vectors():
    """Backward memory: the graph keeps the input logits plus O(T) vectors, never another [T, V] tensor."""
    T, V = 64, 100
    x = torch.randn(T, V, dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, V, (T,))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda s: saved.append(s) or s, lambda s: s):
        token_logprobs(x, t, 1.0, chunk_size=16)
    big = [s for s in saved if s.numel() > T]
    assert len(big) == 1 and big[0].data_ptr() == x.data_ptr() and big[0].dtype == torch.bfloat16
    assert sum(s.numel() for s in saved if s.numel() <= T) <= 3 * T


def test_fused_linear_matches_unfused_values_and_grads():
    g = torch.Generator().manual_seed(2)
    T, H, V = 11, 5, 13
    h = torch.randn(T, H, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, H, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, V, (T,), generator=g)
    a, b = torch.randn(T, generator=g, dtype=torch.float64), torch.randn(T, generator=g, dtype=torch.float64)
    lp, ent = linear_token_logprobs(h, w, t, 0.6, chunk_size=4)
    gh, gw = torch.autograd.grad((a * lp + b * ent).sum(), (h, w))
    rlp, rent = _ref(h @ w.T, t, 0.6)
    rgh, rgw = torch.autograd.grad((a * rlp + b * rent).sum(), (h, w))
    for x, y in [(lp, rlp), (ent, rent), (gh, rgh), (gw, rgw)]:
        torch.testing.assert_close(x, y, rtol=0, atol=1e-12)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda s: saved.append(s) or s, lambda s: s):
        linear_token_logprobs(h, w, t, 0.6, chunk_size=4)
    assert max(s.numel() for s in saved) == V * H  # the weight; no [T, V] tensor is kept


def test_rejects_bad_inputs():
    x = torch.randn(4, 5)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(x, torch.zeros(4, dtype=torch.long), 0.0)
    with pytest.raises(ValueError, match="targets"):
        token_logprobs(x, torch.zeros(3, dtype=torch.long), 1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_peak_memory_16k_tokens_vocab_152k():
    """16384 x 151936 bf16 logits (4.98 GB): forward+backward peak stays far below one fp32 copy (9.96 GB)."""
    T, V, dev = 16384, 151936, "cuda"
    x = torch.randn(T, V, device=dev, dtype=torch.bfloat16).requires_grad_()
    t = torch.randint(0, V, (T,), device=dev)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    lp, ent = token_logprobs(x, t, 0.7, chunk_size=512)
    (lp.sum() + 0.1 * ent.sum()).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    grad_bytes = x.numel() * 2  # the bf16 gradient itself
    print(f"extra peak over logits: {extra / 2**30:.2f} GiB (grad {grad_bytes / 2**30:.2f} GiB)")
    assert extra < grad_bytes + 4 * 512 * V * 4 + (1 << 28)
    rows = torch.arange(0, T, 997, device=dev)
    ref = torch.log_softmax(x[rows].detach().float() / 0.7, -1).gather(1, t[rows, None]).squeeze(1)
    torch.testing.assert_close(lp[rows].detach(), ref, rtol=0, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fused_linear_peak_memory_16k_tokens():
    """Fused lm-head (H=1024, V=151936, 16k tokens, bf16): no [T, V] tensor at all; values match unfused."""
    T, H, V, dev = 16384, 1024, 151936, "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    h = (torch.randn(T, H, device=dev, generator=g) / 8).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(V, H, device=dev, generator=g) / 8).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, V, (T,), device=dev, generator=g)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    lp, ent = linear_token_logprobs(h, w, t, 0.7, chunk_size=512)
    (lp.sum() + 0.1 * ent.sum()).backward()
    end.record()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    print(f"fused fwd+bwd {start.elapsed_time(end):.1f} ms, extra peak {extra / 2**30:.2f} GiB "
          f"(one bf16 [T,V] would be {T * V * 2 / 2**30:.2f} GiB)")
    assert extra < 4 * 512 * V * 4 + V * H * 6 + T * H * 2 + (1 << 28)  # chunk temps + fp32/bf16 weight grad
    with torch.no_grad():
        rows = torch.arange(0, T, 997, device=dev)
        ref, _ = token_logprobs(h[rows] @ w.T, t[rows], 0.7)
    torch.testing.assert_close(lp[rows].detach(), ref, rtol=0, atol=1e-4)
