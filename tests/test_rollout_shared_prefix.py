"""The engine's grouped KV layout (`TorchEngineConfig.shared_prefix`): the n samples of a prompt read one copy of
its K/V. Checked against a brute-force mask, the slot memory it aliases, the copied-prefix slot layout and a
float64 full forward (tiny Qwen3, float32, CPU)."""

from __future__ import annotations

import pytest
import torch

from rlbench.engine import SamplingParams, TorchEngine, TorchEngineConfig
from rlbench.engine.attention import group_decode_mask
from rlbench.engine.kv_cache import CacheShape, KVCache
from rlbench.models import build_model

pytestmark = pytest.mark.usefixtures("one_thread")


def test_group_mask_is_prompt_plus_own_lane():
    """Row r = (group row r // k, sample j = r % k) at position P + t writes at P + t k + j and sees exactly the
    prompt [0, P) and its own tokens P + s k + j for s <= t."""
    k, heads, kv_len = 3, 2, 64
    prefix = torch.tensor([5, 5, 5, 9, 9, 9])
    positions = prefix + torch.tensor([0, 0, 0, 4, 4, 4])
    index, mask = group_decode_mask(positions, prefix, k, heads, kv_len)
    assert mask.shape == (2, 1, k * heads, kv_len)
    for r in range(6):
        p, t, j = int(prefix[r]), int(positions[r] - prefix[r]), r % k
        assert int(index[r]) == p + t * k + j
        want = torch.zeros(kv_len, dtype=torch.bool)
        want[:p] = True
        want[[p + s * k + j for s in range(t + 1)]] = True
        for h in range(heads):  # query rows of group row r // k are (sample, head) pairs
            assert torch.equal(mask[r // k, 0, j * heads + h], want)


def test_group_view_aliases_the_slot_memory():
    """Group row g of `group_view(k)` is the memory of slots [g k, (g + 1) k): position p of head h lies in slot
    g k + p // L_t at position p % L_t (L_t = max_seq_len + pad)."""
    cache = KVCache(CacheShape(num_layers=1, num_kv_heads=2, head_dim=4, num_slots=7, max_seq_len=16), torch.float32,
                    "cpu")
    ks, _ = cache.group_view(3)
    assert ks[0].shape == (2, 2, 3 * cache.k[0].shape[2], 4)  # 7 // 3 = 2 group rows; slot 6 unused
    lt = cache.k[0].shape[2]
    ks[0][1, 1, lt + 5] = 7.0
    slot = cache.k[0].view(-1)  # [slot, head, pos, hd] memory order
    flat = ((1 * 2 + 1) * 3 * lt + lt + 5) * 4
    assert torch.all(slot[flat : flat + 4] == 7.0)
    cache.reset(3)
    assert cache.num_units == 2 and [cache.take(), cache.take()] == [0, 1] and cache.num_free == 0


def _engine(shared: bool, num_slots: int) -> TorchEngine:
    cfg = TorchEngineConfig(max_seq_len=96, num_slots=num_slots, steps_per_sync=4, shared_prefix=shared)
    return TorchEngine(build_model("tiny", seed=0), cfg)


def _prompts(lengths, seed=2):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_shared_prefix_equals_copied_prefix(temperature):
    """n = 3 samples of 6 prompts (lengths 1..17) through 7 slots (2 group rows at a time, so group rows are
    freed and reused mid-run), samples stopping at different steps on stop tokens: the same tokens, finish
    reasons and (to fp32 rounding) log-probs as the slot layout, and log-probs == a float64 full forward."""
    prompts = _prompts([4, 17, 1, 9, 12, 6])
    shared, copied = _engine(True, 7), _engine(False, 7)
    free = copied.generate(prompts, SamplingParams(temperature=temperature, max_new_tokens=21, n=3, seed=11))
    stops = sorted({free[1].token_ids[6], free[7].token_ids[12]})  # tokens some samples emit mid-way
    sampling = SamplingParams(temperature=temperature, max_new_tokens=21, n=3, seed=11, stop_token_ids=stops)
    got, want = shared.generate(prompts, sampling), copied.generate(prompts, sampling)
    assert [(g.prompt_index, g.sample_index) for g in got] == [(i, j) for i in range(6) for j in range(3)]
    assert [g.token_ids for g in got] == [g.token_ids for g in want]
    assert [g.finish_reason for g in got] == [g.finish_reason for g in want]
    assert {g.finish_reason for g in got} == {"stop", "length"}
    if temperature > 0:  # the samples of one group row end at different steps
        assert len({len(g.token_ids) for g in got[3:6]} | {len(g.token_ids) for g in got[:3]}) > 1
    diff = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g.log_probs, w.log_probs))
    assert diff < 2e-6
    if temperature == 0.0:
        return
    ref = build_model("tiny", seed=0)
    for g in got:
        with torch.no_grad():
            ids = torch.tensor([prompts[g.prompt_index] + g.token_ids])
            logits = ref(ids).logits[0, len(prompts[g.prompt_index]) - 1 : -1].double()
        lp = torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(g.token_ids)[:, None])[:, 0]
        assert (lp - torch.tensor(g.log_probs).double()).abs().max() < 5e-6


def test_one_group_row_runs_prompts_one_after_another():
    """num_slots == n: one group row, so each prompt waits for the previous group's last sample."""
    prompts = _prompts([5, 8, 3])
    sampling = SamplingParams(temperature=0.7, max_new_tokens=9, n=4, seed=1, stop_token_ids=[3, 50, 77])
    got = _engine(True, 4).generate(prompts, sampling)
    want = _engine(False, 4).generate(prompts, sampling)
    assert [g.token_ids for g in got] == [g.token_ids for g in want]
    assert all(g.finish_reason in ("stop", "length") for g in got)
