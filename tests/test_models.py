"""rlbench.models: presets, build (seeded, meta), save/load round trip with the tokenizer, tied embeddings."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from safetensors import safe_open

from rlbench.data.tokenizer import build_tokenizer
from rlbench.models import PRESETS, build_config, build_model, load_model, load_tokenizer, save_pretrained


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _chat_ids(tokenizer) -> torch.Tensor:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "12+34=?"}], tokenize=False, add_generation_prompt=True
    )
    return torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"] + [5, 7, 11]])  # [1, T]


def test_cpu_preset_vocab_matches_tokenizer(tok):
    assert PRESETS["tiny"]["vocab_size"] == PRESETS["small"]["vocab_size"] == len(tok) == 128


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match="model 'huge' is neither an existing directory .* nor a model preset.*'small'"):
        build_config("huge")


def test_overrides_with_config_object_raise():
    with pytest.raises(ValueError, match="only apply to a preset name"):
        build_model(build_config("tiny"), vocab_size=64)


def test_build_does_not_mutate_callers_config():
    cfg = build_config("tiny")
    build_model(cfg, attn_implementation="eager")
    assert cfg._attn_implementation != "eager"


def test_same_seed_same_weights_other_seed_differs():
    a, b, c = build_model("tiny", seed=1), build_model("tiny", seed=1), build_model("tiny", seed=2)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


def test_seeded_build_leaves_global_rng_untouched():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model("tiny", seed=7)
    assert torch.equal(torch.rand(3), expected)


def _expected_qwen3_params(p: dict) -> int:
    """Parameter count of a tied-embedding Qwen3 from its hyper-parameters (q/k norms included)."""
    h, hd, L = p["hidden_size"], p["head_dim"], p["num_hidden_layers"]
    q, kv = p["num_attention_heads"] * hd, p["num_key_value_heads"] * hd
    attn = h * q + 2 * h * kv + q * h + 2 * hd  # q,k,v,o projections + q_norm, k_norm
    mlp = 3 * h * p["intermediate_size"]
    return p["vocab_size"] * h + L * (attn + mlp + 2 * h) + h


@pytest.mark.parametrize("preset", ["tiny", "small", "qwen3-0.6b-shape", "qwen3-4b-shape"])
def test_meta_build_has_no_storage_and_exact_param_count(preset):
    model = build_model(preset, meta=True)
    params = list(model.parameters())
    assert all(p.device.type == "meta" for p in params)
    assert sum(p.numel() for p in params) == _expected_qwen3_params(PRESETS[preset])


def test_qwen3_06b_shape_is_the_published_size():
    # Qwen3-0.6B: 0.6 B parameters with tied embeddings (596,049,920 by its config).
    assert _expected_qwen3_params(PRESETS["qwen3-0.6b-shape"]) == 596_049_920


def test_save_load_round_trip_identical_logits_and_tokenizer(tmp_path, tok):
    model = build_model("tiny", vocab_size=len(tok), seed=3).eval()
    save_pretrained(model, tok, tmp_path)
    loaded, tok2 = load_model(tmp_path).eval(), load_tokenizer(tmp_path)
    ids = _chat_ids(tok)
    assert torch.equal(_chat_ids(tok2), ids)
    assert tok2.eos_token == "<|im_end|>" and tok2.pad_token == "<|endoftext|>" and len(tok2) == len(tok)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    for (name, p), q in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(p, q), name


def test_tied_embeddings_stored_once_and_retied_on_load(tmp_path, tok):
    model = build_model("tiny", seed=4)
    save_pretrained(model, tok, tmp_path)
    with safe_open(os.path.join(tmp_path, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    assert json.load(open(os.path.join(tmp_path, "config.json")))["tie_word_embeddings"] is True
    loaded = load_model(tmp_path)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert torch.equal(loaded.lm_head.weight, model.model.embed_tokens.weight)


def test_load_bf16_casts_parameters(tmp_path, tok):
    save_pretrained(build_model("tiny"), tok, tmp_path)
    assert {p.dtype for p in load_model(tmp_path, dtype=torch.bfloat16).parameters()} == {torch.bfloat16}


def test_save_refuses_tokenizer_larger_than_vocab(tmp_path, tok):
    with pytest.raises(ValueError, match="vocab_size=len\\(tokenizer\\)"):
        save_pretrained(build_model("tiny", vocab_size=64), tok, tmp_path)


def test_load_non_hf_dir_raises(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_model(tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_qwen3_06b_shape_bf16_save_load(tmp_path):
    """Random qwen3-0.6b-shape -> save -> timed load on CUDA in bf16; prints load time and memory."""
    model = build_model("qwen3-0.6b-shape", device="cuda", dtype=torch.bfloat16, seed=0)
    save_pretrained(model, None, tmp_path)
    ids = torch.randint(0, 151936, (1, 64), device="cuda")
    with torch.no_grad():
        ref = model(ids).logits
    del model
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    loaded = load_model(tmp_path, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    mem = (torch.cuda.memory_allocated() - base) / 2**30
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    n = sum(p.numel() for p in loaded.parameters())
    print(f"\nqwen3-0.6b-shape bf16: params={n} load_s={load_s:.2f} mem_GiB={mem:.3f} peak_GiB={peak:.3f}")
    assert n == 596_049_920
    assert abs(mem - n * 2 / 2**30) < 0.05  # bf16 weights, tied head stored once
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, ref)
