"""The critic's clipped value loss against an independent float64 implementation of verl's `compute_value_loss`
(verl/trainer/ppo/core_algos.py: `clip_by_value`, ½·max of the two squared errors, `agg_loss` token-mean /
seq-mean-token-mean over the global batch), written here on padded `[B, L]` tensors; its gradient; micro-batches
adding up; garbage at masked positions."""

import pytest
import torch

from rlbench.algorithms import GlobalNorm, LossConfig, loss_token_weights
from rlbench.algorithms.value_loss import value_loss

D = torch.float64
NAN = float("nan")


def _verl_value_loss(vpreds, returns, values, mask, cliprange, mode, n_tokens, n_seqs):
    """verl's compute_value_loss on [B, L]: the global-batch normalisers passed as verl's batch_num_tokens /
    global_batch_size (dp_size 1: this call holds the whole batch)."""
    vclip = torch.max(torch.min(vpreds, values + cliprange), values - cliprange)  # verl_F.clip_by_value
    l1, l2 = (vpreds - returns) ** 2, (vclip - returns) ** 2
    mat = torch.max(l1, l2)
    if mode == "token-mean":
        agg = (mat * mask).sum() / n_tokens
    else:  # seq-mean-token-mean
        per_seq = (mat * mask).sum(-1) / mask.sum(-1)  # verl adds 1e-8 here (for empty rows; none in _batch)
        agg = per_seq.sum() / n_seqs
    clipfrac = ((l2 > l1).to(D) * mask).sum() / mask.sum()
    return 0.5 * agg, clipfrac


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 9, 3, 12, 7, 1]
    mask = (torch.rand(sum(lengths), generator=g, dtype=D) > 0.25).to(D)
    for s in torch.cumsum(torch.tensor([0, *lengths[:-1]]), 0).tolist():
        mask[s] = 1.0  # every sample trains a token (verl's seq-mean excludes empty rows; ours counts N)
    old = torch.randn(sum(lengths), generator=g, dtype=D)
    v = old + 0.4 * torch.randn(sum(lengths), generator=g, dtype=D)  # some inside, some outside old ± 0.2
    ret = old + torch.randn(sum(lengths), generator=g, dtype=D)
    return lengths, mask, v, old, ret


def _pad(x, lengths):
    return torch.nn.utils.rnn.pad_sequence(list(torch.split(x, lengths)), batch_first=True)


@pytest.mark.parametrize("mode,verl_mode", [("token_mean", "token-mean"), ("sample_mean", "seq-mean-token-mean")])
@pytest.mark.parametrize("clip", [0.2, 0.5])
def test_value_loss_matches_verl(mode, verl_mode, clip):
    lengths, mask, v, old, ret = _batch()
    norm = GlobalNorm.from_masks([mask], [lengths])
    w = loss_token_weights(mask, lengths, mode, norm)
    vv = v.clone().requires_grad_()
    loss, metrics = value_loss(vv, old, ret, mask, w, clip)
    vp = _pad(v, lengths).requires_grad_()
    exp, exp_clipfrac = _verl_value_loss(vp, _pad(ret, lengths), _pad(old, lengths), _pad(mask, lengths), clip,
                                         verl_mode, mask.sum(), len(lengths))
    assert abs(loss.item() - exp.item()) < 1e-12
    assert abs(metrics["vf_loss"].item() - exp.item()) < 1e-12
    if mode == "token_mean":  # verl's clipfrac is a token mean
        assert abs(metrics["vf_clipfrac"].item() - exp_clipfrac.item()) < 1e-12
        assert 0 < exp_clipfrac.item() < 1
        assert abs(metrics["vpred_mean"].item() - (v * mask).sum().item() / mask.sum().item()) < 1e-12
        assert abs(metrics["return_mean"].item() - (ret * mask).sum().item() / mask.sum().item()) < 1e-12
    loss.backward()
    exp.backward()
    grad_ref = torch.cat([vp.grad[i, :n] for i, n in enumerate(lengths)])
    torch.testing.assert_close(vv.grad, grad_ref, rtol=0, atol=1e-14)
    # where the clipped term wins and V left the clip range the gradient is 0 (the clipped value is constant)
    frozen = (mask > 0) & ((v - old).abs() > clip) & ((v.clamp(old - clip, old + clip) - ret) ** 2 > (v - ret) ** 2)
    assert frozen.any() and (vv.grad[frozen] == 0).all()


def test_value_loss_unclipped_micro_batches_and_masked_garbage():
    lengths, mask, v, old, ret = _batch(1)
    norm = GlobalNorm.from_masks([mask], [lengths])
    w = loss_token_weights(mask, lengths, "token_mean", norm)
    whole, wm = value_loss(v, old, ret, mask, w, None)
    exp = 0.5 * (((v - ret) ** 2) * mask).sum() / mask.sum()
    assert abs(whole.item() - exp.item()) < 1e-12 and wm["vf_clipfrac"].item() == 0.0
    # two micro-batches under the same global norm add up; NaN/inf at masked positions change nothing
    cut = sum(lengths[:3])
    bad = torch.where(mask > 0, v, torch.tensor(NAN, dtype=D))
    bad_ret = torch.where(mask > 0, ret, torch.tensor(float("inf"), dtype=D))
    parts = [value_loss(bad[s], old[s], bad_ret[s], mask[s], w[s], None) for s in (slice(0, cut), slice(cut, None))]
    assert abs(sum(p[0] for p in parts).item() - whole.item()) < 1e-14
    for k in wm:
        assert abs(sum(p[1][k] for p in parts).item() - wm[k].item()) < 1e-14


def test_value_loss_refuses_bad_input():
    x = torch.zeros(4)
    with pytest.raises(ValueError, match="must all be the same"):
        value_loss(x, x, x, x, torch.zeros(3), 0.2)
    with pytest.raises(ValueError, match="clip=0"):
        value_loss(x, x, x, x, x, 0)
    with pytest.raises(ValueError, match="value_clip=-0.1"):
        LossConfig(value_clip=-0.1)
    assert LossConfig().value_clip == 0.2 and LossConfig(value_clip=None).value_clip is None
