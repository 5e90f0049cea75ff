"""`rlbench.models.value_head`: packed == per-sequence values, the value is the head over the last hidden state, the
on-disk layout round-trips bit for bit and is a plain HF token-classification directory, a causal-LM directory
starts a zero head, the version follows the weights."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModelForTokenClassification

from rlbench.models import build_model, save_pretrained
from rlbench.models.value_head import (
    STAMP_FILE,
    build_value_model,
    load_value_model,
    read_stamp,
    save_value_model,
    token_values,
    value_dir_problem,
    weights_version,
)


def _model(seed: int = 0):
    model = build_value_model("tiny", seed=seed)
    with torch.no_grad():
        torch.manual_seed(seed + 1)
        model.score.weight.normal_()
        model.score.bias.fill_(0.25)
    return model.eval()


def test_packed_values_equal_each_sequence_alone():
    model = _model()
    seqs = [torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 9, 3)]
    tokens = torch.cat(seqs)[None]  # [1, T]
    positions = torch.cat([torch.arange(len(s)) for s in seqs])[None]  # [1, T]
    with torch.no_grad():
        packed = token_values(model, tokens, positions)[0]  # [T]
        alone = torch.cat([token_values(model, s[None])[0] for s in seqs])
        h = model.model(seqs[0][None]).last_hidden_state[0].double()  # [5, H]
    assert packed.dtype == torch.float32 and packed.shape == (17,)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    # the head really reads the decoder's last hidden state: w . h + b, in float64
    ref = h @ model.score.weight.double()[0] + model.score.bias.double()
    torch.testing.assert_close(packed[:5].double(), ref, rtol=1e-5, atol=1e-6)


def test_the_decoder_of_a_preset_is_build_models(tmp_path):
    """Same seed, same decoder as the causal LM `build_model` makes; the head at zero; no global RNG draw."""
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    value = build_value_model("tiny", seed=4)
    assert torch.equal(torch.random.get_rng_state(), state)
    lm = build_model("tiny", seed=4)
    assert torch.equal(value.model.embed_tokens.weight, lm.model.embed_tokens.weight)
    assert not value.score.weight.any() and not value.score.bias.any()


def test_save_load_round_trip_is_bit_exact(tmp_path):
    model = _model()
    version = save_value_model(model, None, tmp_path, {"kind": "reward"})
    assert sorted(os.listdir(tmp_path)) == sorted(["config.json", "model.safetensors", STAMP_FILE])
    assert read_stamp(tmp_path) == {"kind": "reward", "format": 2, "version": version} and len(version) == 16
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForTokenClassification"] and len(config["id2label"]) == 1
    assert value_dir_problem(tmp_path) is None
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(3))
    loaded = load_value_model(tmp_path, require_head=True).eval()
    plain = AutoModelForTokenClassification.from_pretrained(tmp_path).eval()  # the standard HF class loads it
    with torch.no_grad():
        assert torch.equal(token_values(model, ids), token_values(loaded, ids))
        # transformers' own load (weights mapped from the file, unaligned: other kernels, last-bit rounding)
        torch.testing.assert_close(token_values(model, ids), plain(ids).logits[..., 0], rtol=1e-6, atol=1e-6)
    assert weights_version(tmp_path) == version


def test_version_follows_the_weights(tmp_path):
    a, b = _model(), _model()
    va = save_value_model(a, None, tmp_path / "a")
    assert save_value_model(b, None, tmp_path / "b") == va  # same weights, same version
    with torch.no_grad():
        b.score.bias.add_(1.0)
    assert save_value_model(b, None, tmp_path / "b") != va


def test_a_causal_lm_directory_starts_a_zero_head(tmp_path):
    lm = build_model("tiny", seed=2)
    save_pretrained(lm, None, tmp_path)
    torch.manual_seed(0)
    state = torch.random.get_rng_state()
    model = load_value_model(tmp_path)
    assert torch.equal(torch.random.get_rng_state(), state)  # the head's init drew nothing
    assert torch.equal(model.model.embed_tokens.weight, lm.model.embed_tokens.weight)
    with torch.no_grad():
        assert torch.equal(token_values(model, torch.arange(6)[None]), torch.zeros(1, 6))
    assert "not a value model" in value_dir_problem(tmp_path)
    with pytest.raises(ValueError, match="not a value model.*rlbench rm"):
        load_value_model(tmp_path, require_head=True)
    with pytest.raises(ValueError, match="no config.json"):
        load_value_model(tmp_path / "nothing")
