"""RL math at the edges (issue 24, item 6), each against a float64 reference written here:

1. GAE and REINFORCE++ returns skip loss-masked tokens inside a response (multi-turn tool output): the
   recursion runs over the trained tokens only; at masked positions GAE leaves the carried advantage and
   A + V there (as verl), REINFORCE++ 0 (tests/test_algorithms_verl_returns.py compares both with verl).
2. Per-sequence mismatch metrics (PPL, PPL ratio, chi2_seq, ...) average over the rows that have a trained
   token; empty rows (e.g. `mask_truncated`) do not count; NaN when there is none.
3. CISPO without a lower clip (slime's convention: eps_clip >= 1 disables 1 − eps_clip).
4. NaN/±Inf at masked positions never reach the loss, its gradient or a metric.
5. low_var_kl clamps the log-ratio to [−20, 20] before the exponential (verl, miles), then the kl to [−10, 10].
"""

import math

import pytest
import torch

from rlbench.algorithms import (
    GlobalNorm,
    LossConfig,
    MISConfig,
    ResponseBatch,
    approx_kl,
    build_loss,
    build_loss_inputs,
    compute_advantages,
    compute_is_weights,
    gae,
    global_norm,
    is_batch_stats,
    reinforce_pp_advantages,
)
from rlbench.algorithms.aggregation import seq_ids_from_lengths

D = torch.float64
NAN, INF = float("nan"), float("inf")


def _split(xs, lengths):
    out, s = [], 0
    for n in lengths:
        out.append(list(xs[s : s + n]))
        s += n
    return out


# ---------------------------------------------------------------- 1. masked steps in GAE / REINFORCE++
def _gae_ref(r, v, m, gamma, lam):
    """One sequence, python floats: the recursion over the trained (m = 1) tokens only; a masked token holds
    the advantage carried past it."""
    adv, next_v, next_a = [0.0] * len(r), 0.0, 0.0
    for t in reversed(range(len(r))):
        if m[t] == 0:
            adv[t] = next_a
            continue
        delta = r[t] + gamma * next_v - v[t]
        next_a = delta + gamma * lam * next_a
        next_v = v[t]
        adv[t] = next_a
    return adv


def _returns_ref(r, m, gamma):
    g, out = 0.0, [0.0] * len(r)
    for t in reversed(range(len(r))):
        if m[t] != 0:
            g = r[t] + gamma * g
            out[t] = g
    return out


def test_gae_issue_example_skips_the_masked_step():
    r, v, m = torch.tensor([[0, 0, 1.0]], dtype=D), torch.tensor([[0.5, 0.2, 0.3]], dtype=D), torch.tensor([[1, 0, 1.0]])
    adv, ret = gae(r, v, m, 0.9, 0.0)
    # A_2 = 1 − 0.3 = 0.7; A_0 = 0 + 0.9·V_2 − V_0 = 0.27 − 0.5 = −0.23 (V_1 belongs to a masked step);
    # the masked step holds the carried A_2 and A_2 + V_1 (verl's lastgaelam and returns), read by no loss
    torch.testing.assert_close(adv, torch.tensor([[-0.23, 0.7, 0.7]], dtype=D), rtol=0, atol=1e-15)
    torch.testing.assert_close(ret, torch.tensor([[0.27, 0.9, 1.0]], dtype=D), rtol=0, atol=1e-15)
    cfg = LossConfig(advantage_estimator="gae", gamma=0.9, lambd=0.0)
    got = compute_advantages(cfg, torch.tensor([1.0], dtype=D), [3], m[0].to(D), group_size=1, values=v[0])
    torch.testing.assert_close(got, torch.tensor([-0.23, 0.7, 0.7], dtype=D), rtol=0, atol=1e-15)


def _multi_turn(seed=0, lengths=(7, 1, 5, 9, 3, 6)):
    """Responses with masked spans inside them (tool output), a fully masked one and masked tails."""
    g = torch.Generator().manual_seed(seed)
    lengths = list(lengths)
    mask = []
    for n in lengths:
        m = [1.0] * n
        if n >= 5:
            s = int(torch.randint(1, n - 2, (1,), generator=g))
            for t in range(s, min(n - 1, s + 2)):
                m[t] = 0.0
        mask += m
    mask[7] = 0.0  # the length-1 response: nothing trained
    mask[-1] = 0.0  # a masked tail
    R = sum(lengths)
    return lengths, torch.tensor(mask, dtype=D), torch.randn(R, generator=g, dtype=D), g


@pytest.mark.parametrize("gamma,lam", [(0.9, 0.0), (0.95, 0.9), (1.0, 0.7), (0.8, 1.0), (1.0, 1.0)])
def test_gae_matches_masked_loop_reference(gamma, lam):
    lengths, mask, values, g = _multi_turn()
    rewards = torch.randn(len(lengths), generator=g, dtype=D)
    kl_old, kl_ref = torch.randn(len(mask), generator=g, dtype=D), torch.randn(len(mask), generator=g, dtype=D)
    # garbage at masked positions must not matter: NaN values, −inf log-probs (NaN KL)
    values_g = torch.where(mask > 0, values, torch.tensor(NAN, dtype=D))
    old_g = torch.where(mask > 0, kl_old, torch.tensor(-INF, dtype=D))
    cfg = LossConfig(advantage_estimator="gae", gamma=gamma, lambd=lam, kl_coef=0.05)
    got = compute_advantages(cfg, rewards, lengths, mask, group_size=2, values=values_g, old_log_probs=old_g,
                             ref_log_probs=kl_ref)
    exp = []
    for i, (m, v, o, rf) in enumerate(zip(*(_split(x.tolist(), lengths) for x in (mask, values, kl_old, kl_ref)))):
        tok = [-0.05 * (o[t] - rf[t]) if m[t] else 0.0 for t in range(len(m))]
        trained = [t for t in range(len(m)) if m[t]]
        tok[trained[-1] if trained else len(m) - 1] += rewards[i].item()
        exp += _gae_ref(tok, v, m, gamma, lam)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, torch.tensor(exp, dtype=D), rtol=0, atol=1e-12)
    # the padded [B, L] entry point directly: returns = A + V; a NaN V at a masked position stays in its own
    # return (verl reads it there too) and reaches no other position
    pad = torch.nn.utils.rnn.pad_sequence
    r_p = pad([torch.tensor(x, dtype=D) for x in _split(torch.randn(len(mask), generator=g, dtype=D).tolist(),
                                                          lengths)], batch_first=True)
    v_p = pad(list(torch.split(values_g, lengths)), batch_first=True, padding_value=NAN)
    m_p = pad(list(torch.split(mask, lengths)), batch_first=True)
    adv, ret = gae(r_p, v_p, m_p, gamma, lam)
    for b in range(len(lengths)):
        n = lengths[b]
        a_ref = _gae_ref(r_p[b, :n].tolist(), values.split(lengths)[b].tolist(), m_p[b, :n].tolist(), gamma, lam)
        torch.testing.assert_close(adv[b, :n], torch.tensor(a_ref, dtype=D), rtol=0, atol=1e-12)
        on = m_p[b, :n] > 0
        ret_ref = torch.tensor(a_ref, dtype=D) + values.split(lengths)[b]
        torch.testing.assert_close(ret[b, :n][on], ret_ref[on], rtol=0, atol=1e-12)
        assert ret[b, :n][~on].isnan().all()
        assert adv[b, n:].abs().sum() == 0 and ret[b, n:].isnan().all()


def test_reinforce_pp_issue_example_and_masked_loop_reference():
    got = reinforce_pp_advantages(torch.tensor([1.0], dtype=D), [3], torch.tensor([1, 0, 1.0], dtype=D), None, 0.0, 0.9)
    torch.testing.assert_close(got, torch.tensor([0.9, 0.0, 1.0], dtype=D), rtol=0, atol=1e-15)
    lengths, mask, kl, g = _multi_turn(1)
    rewards = torch.randn(len(lengths), generator=g, dtype=D)
    for gamma in (1.0, 0.9, 0.5):
        got = reinforce_pp_advantages(rewards, lengths, mask, kl, 0.1, gamma)
        exp = []
        for i, (m, k) in enumerate(zip(_split(mask.tolist(), lengths), _split(kl.tolist(), lengths))):
            tok = [-0.1 * k[t] if m[t] else 0.0 for t in range(len(m))]
            trained = [t for t in range(len(m)) if m[t]]
            tok[trained[-1] if trained else len(m) - 1] += rewards[i].item()
            exp += _returns_ref(tok, m, gamma)
        torch.testing.assert_close(got, torch.tensor(exp, dtype=D), rtol=0, atol=1e-12)
        # through compute_advantages (k1 KL = old − ref, −inf log-probs on masked tokens), whitened by hand
        cfg = LossConfig(advantage_estimator="reinforce_plus_plus", normalize_advantages=True, kl_coef=0.1,
                         gamma=gamma)
        old = torch.where(mask > 0, kl, torch.tensor(-INF, dtype=D))
        full = compute_advantages(cfg, rewards, lengths, mask, group_size=2, old_log_probs=old,
                                  ref_log_probs=torch.zeros_like(kl))
        sel = [x for x, m in zip(exp, mask.tolist()) if m]
        mean = sum(sel) / len(sel)
        var = sum((x - mean) ** 2 for x in sel) / (len(sel) - 1)
        white = [(x - mean) / math.sqrt(var + 1e-8) for x in exp]
        trained = mask > 0
        torch.testing.assert_close(full[trained], torch.tensor(white, dtype=D)[trained], rtol=0, atol=1e-12)
        assert torch.isfinite(full).all()


# ---------------------------------------------------------------- 2. empty rows in per-sequence metrics
def _metrics(cfg, rows, split=None):
    """rows: list of (old, rollout, mask) python lists; split: micro-batch sizes in rows (one rank)."""
    split = split or [len(rows)]
    mbs, s = [], 0
    for k in split:
        part = rows[s : s + k]
        s += k
        old, roll, mask = (torch.tensor([x for r in part for x in r[j]], dtype=D) for j in range(3))
        mbs.append(ResponseBatch(loss_mask=mask, advantages=torch.zeros_like(mask),
                                 response_lengths=[len(r[0]) for r in part], old_log_probs=old,
                                 rollout_log_probs=roll))
    loss_fn, out = build_loss(cfg), {}
    for mb, inputs in zip(mbs, build_loss_inputs(cfg, mbs)):
        _, m = loss_fn(mb.old_log_probs.clone(), None, inputs)
        for k, v in m.items():
            out[k] = out.get(k, 0.0) + v.item()
    return out


def _seq_ref(rows):
    """Per-sequence metrics averaged over the rows with a trained token (python floats)."""
    per = []
    for old, roll, m in rows:
        n = sum(m)
        if n == 0:
            continue
        tlp = -sum(o * k for o, k in zip(old, m)) / n
        rlp = -sum(r * k for r, k in zip(roll, m)) / n
        slr = max(-20.0, min(20.0, sum((o - r) * k for o, r, k in zip(old, roll, m))))
        per.append({
            "mismatch_training_log_ppl": tlp, "mismatch_rollout_log_ppl": rlp,
            "mismatch_training_ppl": math.exp(tlp), "mismatch_rollout_ppl": math.exp(rlp),
            "mismatch_log_ppl_diff": tlp - rlp, "mismatch_log_ppl_abs_diff": abs(tlp - rlp),
            "mismatch_ppl_ratio": math.exp(tlp - rlp), "mismatch_chi2_seq": math.exp(2 * slr) - 1,
        })
    return {k: sum(p[k] for p in per) / len(per) for k in per[0]}


def test_issue_example_empty_row_does_not_count_in_ppl():
    m = _metrics(LossConfig(), [([-1.0, -1.0], [-1.0, -1.0], [1.0, 1.0]), ([-2.0], [-2.0], [0.0])])
    assert abs(m["mismatch_training_ppl"] - math.e) < 1e-12  # was e/2 = 1.359
    assert abs(m["mismatch_rollout_ppl"] - math.e) < 1e-12 and abs(m["mismatch_ppl_ratio"] - 1.0) < 1e-12


@pytest.mark.parametrize("aggregation", ["sample_mean", "token_mean", "seq_sum_constant"])
def test_per_sequence_metrics_average_over_non_empty_rows(aggregation):
    g = torch.Generator().manual_seed(5)
    rows = []
    for n, empty in [(3, False), (2, True), (4, False), (1, True), (5, False), (3, False)]:
        roll = (-torch.rand(n, generator=g, dtype=D) * 3).tolist()
        old = [r + 0.4 * float(torch.randn(1, generator=g, dtype=D)) for r in roll]
        m = [0.0] * n if empty else [1.0] * n
        if not empty and n > 2:
            m[1] = 0.0
        rows.append((old, roll, m))
    cfg = LossConfig(loss_aggregation=aggregation, loss_aggregation_constant=4.0)
    exp = _seq_ref(rows)
    for split in ([6], [2, 1, 3], [1] * 6):
        got = _metrics(cfg, rows, split)
        for k, v in exp.items():
            assert abs(got[k] - v) < 1e-12 * max(1.0, abs(v)), (k, split, got[k], v)


def test_per_sequence_metrics_across_dp_ranks_and_mis_sequence_values():
    """Two simulated ranks: the count of non-empty rows is all-reduced with the other counts."""
    g = torch.Generator().manual_seed(6)
    lengths = [3, 2, 4, 1, 5, 2]
    mask = torch.tensor([1, 1, 1, 0, 0, 1, 0, 1, 1, 0, 1, 1, 1, 1, 1, 1, 0], dtype=D)
    roll = -torch.rand(len(mask), generator=g, dtype=D) * 3
    old = roll + 0.3 * torch.randn(len(mask), generator=g, dtype=D)
    old[12] = roll[12] + math.log(1e-5)  # vetoes the 5th sequence
    cfg = LossConfig(use_tis=True, mis=MISConfig(tis_level="sequence"))
    cut = sum(lengths[:3])

    def mb(sl, ls):
        return ResponseBatch(loss_mask=mask[sl], advantages=torch.zeros_like(mask[sl]), response_lengths=ls,
                             old_log_probs=old[sl], rollout_log_probs=roll[sl])

    ranks = [[mb(slice(0, cut), lengths[:3])], [mb(slice(cut, None), lengths[3:])]]
    norm = GlobalNorm.combine([global_norm(cfg, r) for r in ranks])
    assert norm.n_nonempty == 4
    stats = sum(is_batch_stats(cfg, r) for r in ranks)
    out = {}
    for r in ranks:
        for b, inputs in zip(r, build_loss_inputs(cfg, r, norm=norm, batch_stats=stats)):
            _, m = build_loss(cfg)(b.old_log_probs.clone(), None, inputs)
            for k, v in m.items():
                out[k] = out.get(k, 0.0) + v.item()
    rows = list(zip(*(_split(x.tolist(), lengths) for x in (old, roll, mask))))
    for k, v in _seq_ref(rows).items():
        assert abs(out[k] - v) < 1e-12 * max(1.0, abs(v)), k
    assert abs(out["mis_rs_catastrophic_seq_fraction"] - 0.25) < 1e-12  # 1 of the 4 non-empty rows
    full = compute_is_weights(cfg, old, roll, mask, seq_ids_from_lengths(lengths), len(lengths))
    factor = full.metrics["mis_batch_norm_factor"][0].item()
    assert abs(out["mis_batch_norm_factor"] - factor) < 1e-12  # a scalar is reported as itself


def test_no_trained_token_reports_nan_for_per_sequence_metrics():
    m = _metrics(LossConfig(), [([-1.0, -1.0], [-1.5, -1.0], [0.0, 0.0]), ([-2.0], [-2.0], [0.0])])
    for k in ("mismatch_training_ppl", "mismatch_rollout_ppl", "mismatch_ppl_ratio", "mismatch_chi2_seq"):
        assert math.isnan(m[k]), k
    assert m["loss"] == 0.0 and m["train_rollout_logprob_abs_diff"] == 0.0


# ---------------------------------------------------------------- 3. CISPO without a lower bound
@pytest.mark.parametrize("eps_clip", [1.0, 5.0, INF])
def test_cispo_upper_only(eps_clip):
    cfg = LossConfig(policy_loss="cispo", eps_clip=eps_clip, eps_clip_high=0.28)
    g = torch.Generator().manual_seed(3)
    n = 8
    old = -torch.rand(n, generator=g, dtype=D) * 2
    log_ratio = torch.tensor([-3.0, -1.0, -0.5, -0.1, 0.0, 0.1, 0.3, 1.0], dtype=D)  # r from 0.05 to 2.7
    new = (old + log_ratio).requires_grad_()
    adv = torch.randn(n, generator=g, dtype=D)
    mask = torch.ones(n, dtype=D)
    mb = ResponseBatch(loss_mask=mask, advantages=adv, response_lengths=[n], old_log_probs=old)
    loss, m = build_loss(cfg)(new, None, build_loss_inputs(cfg, [mb])[0])
    loss.backward()
    coef = [min(math.exp(x), 1.28) for x in log_ratio.tolist()]  # no lower clip: 0.05 stays 0.05
    exp_loss = sum(-c * a * lp for c, a, lp in zip(coef, adv.tolist(), new.tolist())) / n
    assert abs(loss.item() - exp_loss) < 1e-13
    torch.testing.assert_close(new.grad, torch.tensor([-c * a / n for c, a in zip(coef, adv.tolist())], dtype=D),
                               rtol=0, atol=1e-14)
    assert abs(m["pg_clipfrac"] - 2 / n) < 1e-15  # only r = e^0.3, e^1 (> 1.28) are clipped
    with pytest.raises(ValueError, match="eps_clip"):
        LossConfig(policy_loss="ppo", eps_clip=eps_clip)  # PPO/GSPO still need a lower clip in [0, 1)
    with pytest.raises(ValueError, match="eps_clip"):
        LossConfig(policy_loss="cispo", eps_clip=-0.1)


# ---------------------------------------------------------------- 4. non-finite values at masked positions
LENS = [4, 3, 1, 5, 2]
MASK = torch.tensor([1, 1, 0, 1, 1, 0, 1, 0, 0, 1, 1, 1, 0, 1, 1], dtype=D)  # 3rd sequence empty
EDGE_CONFIGS = {
    "ppo": dict(eps_clip=0.2, eps_clip_high=0.28),
    "dual_clip": dict(eps_clip=0.2, eps_clip_c=3.0),
    "gspo": dict(policy_loss="gspo", eps_clip=0.05),
    "cispo": dict(policy_loss="cispo", eps_clip=1.0, eps_clip_high=0.28),
    "opsm": dict(use_opsm=True, opsm_delta=1e-4),
    "k1_tis": dict(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k1", use_tis=True, tis_clip_low=0.5),
    "k2_token_mean": dict(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k2", loss_aggregation="token_mean"),
    "k3_entropy": dict(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k3", entropy_coef=0.01),
    "low_var_unbiased_mis": dict(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl", use_unbiased_kl=True,
                                 use_tis=True, mis=MISConfig(tis_level="sequence", rs_level="geometric")),
    "mis_token_clip": dict(use_tis=True, mis=MISConfig(tis_mode="clip", rs_veto_threshold=1e-3)),
    "bypass": dict(use_rollout_logprobs=True, use_opsm=True),
}


def _edge_data(seed=0):
    g = torch.Generator().manual_seed(seed)
    R = len(MASK)
    old = -torch.rand(R, generator=g, dtype=D) * 2
    new = old + 0.3 * torch.randn(R, generator=g, dtype=D)
    roll = old + 0.3 * torch.randn(R, generator=g, dtype=D)
    ref = old + 0.3 * torch.randn(R, generator=g, dtype=D)
    adv = torch.randn(R, generator=g, dtype=D)
    ent = torch.rand(R, generator=g, dtype=D)
    return dict(old=old, new=new, roll=roll, ref=ref, adv=adv, ent=ent)


def _poison(d):
    """The same data with −inf / +inf / NaN on every masked token."""
    out = {}
    bad = torch.tensor([-INF, NAN, INF, -INF, NAN, -INF, NAN], dtype=D)
    idx = torch.nonzero(MASK == 0).flatten()
    for j, (k, v) in enumerate(d.items()):
        v = v.clone()
        v[idx] = bad[(torch.arange(len(idx)) + j) % len(bad)]
        out[k] = v
    return out


def _ref_loss(cfg, d, new):
    """The loss from the formulas over the TRAINED tokens only (float64 torch, autograd for the gradient)."""
    keep = MASK > 0
    seq = seq_ids_from_lengths(LENS)[keep]
    n_seq = len(LENS)
    old = d["roll"][keep] if cfg.use_rollout_logprobs else d["old"][keep]
    lp, adv, roll, ref, ent = new[keep], d["adv"][keep], d["roll"][keep], d["ref"][keep], d["ent"][keep]
    cnt = torch.zeros(n_seq, dtype=D).index_add(0, seq, torch.ones_like(lp))

    def seq_mean(x):
        return (torch.zeros(n_seq, dtype=D).index_add(0, seq, x) / cnt.clamp_min(1))[seq]

    lr = seq_mean(lp - old) if cfg.policy_loss == "gspo" else lp - old
    r = torch.exp(lr)
    if cfg.policy_loss == "cispo":
        pg = -torch.clamp(r, 1 - cfg.eps_clip, 1 + cfg.eps_clip_high).detach() * adv * lp
    else:
        pg = torch.maximum(-r * adv, -r.clamp(1 - cfg.eps_clip, 1 + cfg.eps_clip_high) * adv)
        if cfg.eps_clip_c is not None:
            pg = torch.where(adv < 0, torch.minimum(pg, -cfg.eps_clip_c * adv), pg)
    if cfg.use_opsm:
        pg = pg * (~((adv < 0) & (seq_mean((old - lp).detach()) > cfg.opsm_delta))).to(D)
    if cfg.use_tis:
        delta = (old - roll).detach()
        if cfg.mis is None:
            pg = pg * torch.exp(delta).clamp(cfg.tis_clip_low, cfg.tis_clip)
        else:  # the two MIS configs above, written out
            c = cfg.mis
            if c.tis_level == "sequence":
                w = torch.exp((torch.zeros(n_seq, dtype=D).index_add(0, seq, delta))[seq].clamp(-20, 20))
            else:
                w = torch.exp(delta)
            w = w.clamp(c.tis_lower_bound, c.tis_upper_bound) if c.tis_mode == "clip" else w.clamp(max=c.tis_upper_bound)
            rs = torch.exp(seq_mean(delta) if c.rs_level == "geometric" else delta)
            keep_w = ((rs >= c.rs_lower_bound) & (rs <= c.rs_upper_bound)).to(D)
            veto = torch.zeros(n_seq, dtype=D).index_add(0, seq, (delta < math.log(c.rs_veto_threshold)).to(D))[seq]
            keep_w = keep_w * (veto == 0).to(D)
            w = w * keep_w
            if c.tis_level == "token":
                factor = (w * keep_w).sum() / keep_w.sum()
            else:
                kc = torch.zeros(n_seq, dtype=D).index_add(0, seq, keep_w)
                sm = torch.zeros(n_seq, dtype=D).index_add(0, seq, w * keep_w) / kc.clamp_min(1)
                factor = sm[kc > 0].sum() / (kc > 0).sum()
            pg = pg * w / factor
    if cfg.loss_aggregation == "token_mean":
        wt = torch.full_like(lp, 1.0 / len(lp))
    else:
        wt = 1.0 / (cnt[seq] * n_seq)  # sample_mean: the empty sequence counts in N (slime)
    loss = (wt * pg).sum()
    if cfg.use_kl_loss:
        dd = lp - ref
        if cfg.kl_loss_type == "low_var_kl":
            dd = dd.clamp(-20, 20)
        kl = {"k1": dd, "k2": dd * dd / 2, "k3": torch.exp(-dd) - 1 + dd, "low_var_kl": torch.exp(-dd) - 1 + dd}[
            cfg.kl_loss_type]
        if cfg.use_unbiased_kl:
            kl = kl * torch.exp(lp - old)
        if cfg.kl_loss_type == "low_var_kl":
            kl = kl.clamp(-10, 10)
        loss = loss + cfg.kl_loss_coef * (wt * kl).sum()
    if cfg.entropy_coef:
        loss = loss - cfg.entropy_coef * (wt * ent).sum()
    return loss


@pytest.mark.parametrize("name", list(EDGE_CONFIGS))
def test_non_finite_values_at_masked_positions_never_reach_loss_grad_or_metrics(name):
    cfg = LossConfig(**EDGE_CONFIGS[name])
    clean = _edge_data()
    d = _poison(clean)
    new = d["new"].clone().requires_grad_()
    mb = ResponseBatch(loss_mask=MASK, advantages=d["adv"], response_lengths=LENS, old_log_probs=d["old"],
                       rollout_log_probs=d["roll"], ref_log_probs=d["ref"])
    (inputs,) = build_loss_inputs(cfg, [mb])
    loss, metrics = build_loss(cfg)(new, d["ent"], inputs)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(new.grad).all(), (loss, new.grad)
    for k, v in metrics.items():
        assert torch.isfinite(v), k
    ref_new = clean["new"].clone().requires_grad_()
    ref = _ref_loss(cfg, clean, ref_new)
    ref.backward()
    assert abs(loss.item() - ref.item()) < 1e-12, (loss.item(), ref.item())
    torch.testing.assert_close(new.grad, ref_new.grad * MASK, rtol=1e-10, atol=1e-13)
    assert torch.all(new.grad[MASK == 0] == 0)


def test_non_finite_values_at_masked_positions_in_is_weights_and_advantages():
    clean = _edge_data(1)
    d = _poison(clean)
    seq = seq_ids_from_lengths(LENS)
    cfgs = (LossConfig(), LossConfig(use_tis=True), LossConfig(use_tis=True, mis=MISConfig(tis_level="sequence")),
            LossConfig(use_tis=True, mis=MISConfig(rs_level="geometric", tis_mode="mask")))
    for cfg in cfgs:
        got = compute_is_weights(cfg, d["old"], d["roll"], MASK, seq, len(LENS))
        exp = compute_is_weights(cfg, clean["old"], clean["roll"], MASK, seq, len(LENS))
        keep = MASK > 0  # values AT masked positions are unspecified (PolicyLoss zeroes them); trained ones exact
        for k, v in exp.metrics.items():
            assert torch.isfinite(got.metrics[k][keep]).all(), k
            torch.testing.assert_close(got.metrics[k][keep], v[keep], rtol=0, atol=1e-13)
        if exp.weights is not None:
            assert torch.isfinite(got.weights[keep]).all()
            torch.testing.assert_close(got.weights[keep], exp.weights[keep], rtol=0, atol=1e-13)
        if exp.batch_stats is not None:
            torch.testing.assert_close(got.batch_stats, exp.batch_stats, rtol=0, atol=1e-13)
    rewards = torch.tensor([1.0, 0.0, 0.5, -1.0, 2.0, 0.3], dtype=D)[: len(LENS)]
    for est in ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae"):
        cfg = LossConfig(advantage_estimator=est, normalize_advantages=True, kl_coef=0.05,
                         kl_loss_type="k3", gamma=0.9, lambd=0.95)
        kw = dict(group_size=1 if est != "reinforce_plus_plus_baseline" else 5)
        got = compute_advantages(cfg, rewards, LENS, MASK, old_log_probs=d["old"], ref_log_probs=d["ref"],
                                 values=d["adv"], **kw)
        exp = compute_advantages(cfg, rewards, LENS, MASK, old_log_probs=clean["old"], ref_log_probs=clean["ref"],
                                 values=clean["adv"], **kw)
        keep = MASK > 0
        assert torch.isfinite(got).all(), est
        torch.testing.assert_close(got[keep], exp[keep], rtol=0, atol=1e-12)


# ---------------------------------------------------------------- 5. the k3 clamp
@pytest.mark.parametrize("unbiased", [False, True])
def test_low_var_kl_clamps_the_log_ratio_before_exp(unbiased):
    gap = [5.0, -5.0, 2.0, 25.0, -25.0, 709.0, 710.0, 800.0, 1e4, -800.0]  # ref − logp
    ref = torch.zeros(len(gap), dtype=D)
    lp = torch.tensor([-x for x in gap], dtype=D).requires_grad_()
    old = (lp.detach() - 0.1) if unbiased else None
    kl = approx_kl(lp, ref, "low_var_kl", old_log_probs=old)
    kl.sum().backward()
    for i, x in enumerate(gap):
        d = max(-20.0, min(20.0, -x))
        k3 = math.exp(-d) - 1 + d
        dk3 = (1 - math.exp(-d)) if abs(x) < 20 else 0.0  # clamp(d) passes no gradient outside [−20, 20]
        ratio = math.exp(0.1) if unbiased else 1.0
        raw = k3 * ratio
        exp_v = max(-10.0, min(10.0, raw))
        exp_g = 0.0 if abs(raw) > 10 else ratio * (dk3 + (k3 if unbiased else 0.0))
        assert abs(kl[i].item() - exp_v) < 1e-12 * max(1, abs(exp_v)), (x, kl[i].item(), exp_v)
        assert math.isfinite(lp.grad[i].item()) and abs(lp.grad[i].item() - exp_g) < 1e-12, (x, lp.grad[i], exp_g)
    # the loss term (make_kl_fn) behaves the same
    cfg = LossConfig(use_kl_loss=True, kl_loss_coef=1.0, kl_loss_type="low_var_kl", use_unbiased_kl=unbiased)
    lp2 = lp.detach().clone().requires_grad_()
    n = len(gap)
    mb = ResponseBatch(loss_mask=torch.ones(n, dtype=D), advantages=torch.zeros(n, dtype=D), response_lengths=[n],
                       old_log_probs=old if unbiased else lp2.detach().clone(), ref_log_probs=ref)
    loss, _ = build_loss(cfg)(lp2, None, build_loss_inputs(cfg, [mb])[0])
    loss.backward()
    torch.testing.assert_close(lp2.grad, lp.grad / n, rtol=0, atol=1e-14)
