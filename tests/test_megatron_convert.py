"""HF <-> megatron-core weight conversion: bit-exact round trips through TP/PP splits, negative controls, and the
names and shapes of a real megatron-core GPTModel."""

from __future__ import annotations

import contextlib
import dataclasses
import socket

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config

from rlbench.backends.megatron.convert import (
    Layout,
    gather_pp,
    gather_tp,
    gather_tp_param,
    hf_to_mcore,
    mcore_param_to_hf,
    mcore_to_hf,
    shard_pp,
    shard_tp,
    stage_layers,
    tp_partition_dim,
)
from rlbench.models import build_config, build_model

TINY = Layout.from_hf_config(build_config("tiny"))  # tied, qk norms, 4 q heads on 2 kv groups
TINY_UNTIED = dataclasses.replace(TINY, tied=False)
# Llama/Qwen2-style: qkv bias, no qk norm, 4 q heads per group, 3 layers (uneven PP), heads*head_dim != hidden
LLAMA_LIKE = Layout(num_layers=3, hidden=48, num_heads=8, num_kv_heads=2, head_dim=8, ffn=96, vocab=96,
                    tied=False, qk_norm=False, qkv_bias=True)
QKV = "decoder.layers.0.self_attention.linear_qkv.weight"
FC1 = "decoder.layers.0.mlp.linear_fc1.weight"


def hf_shapes(lay: Layout) -> dict[str, tuple[int, ...]]:
    """HF names and shapes, written out independently of the converter's tables."""
    h, hn, q, kv, f = lay.hidden, lay.head_dim, lay.num_heads * lay.head_dim, lay.num_kv_heads * lay.head_dim, lay.ffn
    out = {"model.embed_tokens.weight": (lay.vocab, h), "model.norm.weight": (h,)}
    if not lay.tied:
        out["lm_head.weight"] = (lay.vocab, h)
    for i in range(lay.num_layers):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f)}
        if lay.qk_norm:
            out |= {p + "self_attn.q_norm.weight": (hn,), p + "self_attn.k_norm.weight": (hn,)}
        if lay.qkv_bias:
            out |= {p + f"self_attn.{x}_proj.bias": (s,) for x, s in (("q", q), ("k", kv), ("v", kv))}
    return out


def random_hf(lay: Layout, dtype: torch.dtype = torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bfloat16:  # random bits are ~5x cheaper than randn at 0.6B scale; the mask keeps them finite
        return {n: (torch.empty(s, dtype=torch.int16).random_(generator=g) & 0xBFFF).view(dtype)
                for n, s in hf_shapes(lay).items()}
    return {n: torch.randn(s, generator=g, dtype=dtype) for n, s in hf_shapes(lay).items()}


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    bad = [n for n in want if got[n].dtype != want[n].dtype or not torch.equal(got[n], want[n])]
    assert not bad, f"differ: {bad}"


def round_trip(hf: dict, lay: Layout, tp: int, pp: int, layers_per_stage=None) -> dict:
    mc = hf_to_mcore(hf, lay)
    stages = [shard_pp(mc, lay, pp, r, layers_per_stage) for r in range(pp)]
    local = [[shard_tp(stage, lay, tp, t) for t in range(tp)] for stage in stages]
    return mcore_to_hf(gather_pp([gather_tp(ranks, lay) for ranks in local], lay), lay)


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("lay", [TINY, TINY_UNTIED, LLAMA_LIKE], ids=["tied", "untied", "llama_like"])
def test_round_trip_bit_exact(lay, tp, pp):
    hf = random_hf(lay)
    lps = [1, 2] if lay.num_layers == 3 and pp == 2 else None
    assert_same(round_trip(hf, lay, tp, pp, lps), hf)


@pytest.mark.parametrize("tied", [True, False])
def test_real_hf_model_names_and_shapes(tied):
    model = build_model("tiny", tie_word_embeddings=tied)
    sd = model.state_dict()  # a tied model lists lm_head.weight as an alias of embed_tokens
    lay = Layout.from_hf_config(model.config)
    assert lay == dataclasses.replace(TINY, tied=tied)
    want = {n: t for n, t in sd.items() if not (tied and n == "lm_head.weight")}
    assert {n: tuple(t.shape) for n, t in want.items()} == hf_shapes(lay)
    assert_same(mcore_to_hf(hf_to_mcore(sd, lay), lay), want)


def test_qwen3_06b_shapes_tp2_pp2_bf16():
    # The preset's shapes (vocab 151936, 16 q heads on 8 groups, heads*head_dim=2048 != hidden 1024) on 4 of its
    # 28 layers: the other layers repeat the same shapes, and all 28 take ~30 s on the 2-core CI box.
    lay = dataclasses.replace(Layout.from_hf_config(build_config("qwen3-0.6b-shape")), num_layers=4)
    assert (lay.vocab, lay.num_heads, lay.num_kv_heads, lay.head_dim, lay.hidden) == (151936, 16, 8, 128, 1024)
    hf = random_hf(lay, torch.bfloat16)
    assert_same(round_trip(hf, lay, tp=2, pp=2), hf)


@pytest.mark.parametrize("lay", [TINY, TINY_UNTIED, LLAMA_LIKE], ids=["tied", "untied", "llama_like"])
def test_streaming_weight_sync_path(lay):
    """Per parameter: gather TP shards, then mcore_param_to_hf with the stage's layer offset (the weight-sync path)."""
    hf = random_hf(lay)
    mc, pp, tp = hf_to_mcore(hf, lay), 2, 2
    lps = [1, 2] if lay.num_layers == 3 else None
    got = {}
    for r, layers in enumerate(stage_layers(lay, pp, lps)):
        ranks = [shard_tp(shard_pp(mc, lay, pp, r, lps), lay, tp, t) for t in range(tp)]
        for name in ranks[0]:
            full = gather_tp_param(name, [s[name] for s in ranks], lay)
            for n, t in mcore_param_to_hf(name, full, lay, layer_offset=layers.start):
                assert n not in got
                got[n] = t
    assert_same(got, hf)


def test_tp_shards_hold_what_megatron_expects():
    lay, tp = TINY, 2
    hf = random_hf(lay)
    q, k, v = (hf[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv")
    gate, up, o = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"], \
        hf["model.layers.0.self_attn.o_proj.weight"]
    mc = hf_to_mcore(hf, lay)
    local = dataclasses.replace(lay, num_heads=lay.num_heads // tp, num_kv_heads=lay.num_kv_heads // tp)
    for r in range(tp):
        shard = shard_tp(mc, lay, tp, r)
        # rank r holds kv group r: its q heads, k_r, v_r (one group per rank here)
        lq, lk, lv = (t for _, t in mcore_param_to_hf(QKV, shard[QKV], local))
        assert torch.equal(lq, q.chunk(tp)[r]) and torch.equal(lk, k.chunk(tp)[r]) and torch.equal(lv, v.chunk(tp)[r])
        assert torch.equal(shard[FC1], torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]]))
        assert torch.equal(shard["decoder.layers.0.self_attention.linear_proj.weight"], o.chunk(tp, dim=1)[r])
        assert torch.equal(shard["embedding.word_embeddings.weight"], hf["model.embed_tokens.weight"].chunk(tp)[r])
        assert torch.equal(shard["decoder.layers.0.self_attention.q_layernorm.weight"],
                           hf["model.layers.0.self_attn.q_norm.weight"])
    assert [tp_partition_dim(n) for n in (QKV, FC1, "output_layer.weight", "decoder.layers.3.mlp.linear_fc2.weight",
                                          "decoder.final_layernorm.weight")] == [0, 0, 0, 1, None]


def test_pp_stages_layout():
    mc = hf_to_mcore(random_hf(LLAMA_LIKE), LLAMA_LIKE)
    s0, s1 = (shard_pp(mc, LLAMA_LIKE, 2, r, [1, 2]) for r in range(2))
    assert {n.split(".self_attention")[0] for n in s1 if "linear_qkv.weight" in n} == \
        {"decoder.layers.0", "decoder.layers.1"}
    assert torch.equal(s1["decoder.layers.0.mlp.linear_fc2.weight"], mc["decoder.layers.1.mlp.linear_fc2.weight"])
    assert "embedding.word_embeddings.weight" in s0 and "output_layer.weight" not in s0
    assert "decoder.final_layernorm.weight" in s1 and "embedding.word_embeddings.weight" not in s1
    # tied + PP>1: the last stage holds output_layer.weight, a copy of the embedding; gather drops it again
    tied = hf_to_mcore(random_hf(TINY), TINY)
    last = shard_pp(tied, TINY, 2, 1)
    assert torch.equal(last["output_layer.weight"], tied["embedding.word_embeddings.weight"])
    assert "output_layer.weight" not in shard_pp(tied, TINY, 1, 0)
    assert mcore_param_to_hf("output_layer.weight", last["output_layer.weight"], TINY) == []


def test_from_hf_config_llama_and_qwen2():
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=128, tie_word_embeddings=False)
    llama, qwen2 = Layout.from_hf_config(LlamaConfig(**kw)), Layout.from_hf_config(Qwen2Config(**kw))
    assert (llama.qk_norm, llama.qkv_bias, llama.head_dim) == (False, False, 16)
    assert (qwen2.qk_norm, qwen2.qkv_bias, qwen2.head_dim) == (False, True, 16)
    with pytest.raises(ValueError, match="o_proj"):
        Layout.from_hf_config(LlamaConfig(**kw, attention_bias=True))


def test_negative_control_naive_fused_splits_do_not_round_trip():
    lay, tp = TINY, 2
    hf = random_hf(lay)
    mc = hf_to_mcore(hf, lay)
    # fc1: a plain dim-0 chunk gives rank 0 all of gate; the correct gather then does not restore the tensor
    naive = list(mc[FC1].chunk(tp))
    assert not torch.equal(gather_tp_param(FC1, naive, lay), mc[FC1])
    assert torch.equal(gather_tp_param(FC1, [shard_tp(mc, lay, tp, r)[FC1] for r in range(tp)], lay), mc[FC1])
    # qkv: HF order cat([q, k, v]) instead of group-major puts k/v rows into q
    q, k, v = (hf[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv")
    back = mcore_to_hf(mc | {QKV: torch.cat([q, k, v])}, lay)
    assert not torch.equal(back["model.layers.0.self_attn.q_proj.weight"], q)
    assert torch.equal(mcore_to_hf(mc, lay)["model.layers.0.self_attn.q_proj.weight"], q)


def test_errors_name_the_problem():
    hf = random_hf(TINY)
    mc = hf_to_mcore(hf, TINY)
    with pytest.raises(ValueError, match=r"num_kv_heads=2 is not divisible by tp_size=4.*divides num_kv_heads"):
        shard_tp(mc, TINY, 4, 0)
    with pytest.raises(ValueError, match="num_kv_heads=2 is not divisible by tp_size=4"):
        gather_tp_param(QKV, [mc[QKV]] * 4, TINY)
    with pytest.raises(ValueError, match="vocab=127 is not divisible by tp_size=2"):
        shard_tp({}, dataclasses.replace(TINY, vocab=127), 2, 0)
    with pytest.raises(ValueError, match=r"unknown keys \['model.layers.0.self_attn.rotary_emb.inv_freq'\]"):
        hf_to_mcore(hf | {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}, TINY)
    with pytest.raises(ValueError, match=r"missing keys \['model.norm.weight'\]"):
        hf_to_mcore({n: t for n, t in hf.items() if n != "model.norm.weight"}, TINY)
    with pytest.raises(ValueError, match=r"unknown keys \['output_layer.weight'\]"):
        mcore_to_hf(mc | {"output_layer.weight": mc["embedding.word_embeddings.weight"]}, TINY)
    with pytest.raises(ValueError, match="decoder.layers.0.mlp.foo.weight"):
        mcore_param_to_hf("decoder.layers.0.mlp.foo.weight", torch.ones(1), TINY)
    with pytest.raises(ValueError, match="rotary"):
        tp_partition_dim("rotary_pos_emb.inv_freq")
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        hf_to_mcore(hf | {"lm_head.weight": torch.zeros(128, 64)}, TINY)
    with pytest.raises(ValueError, match="num_layers=3 is not divisible by pp_size=2.*layers_per_stage"):
        shard_pp(hf_to_mcore(random_hf(LLAMA_LIKE), LLAMA_LIKE), LLAMA_LIKE, 2, 0)


@pytest.fixture
def megatron_world_1():
    """A one-process gloo world with megatron's model-parallel groups at TP=PP=1, torn down afterwards."""
    pytest.importorskip("megatron.core")
    import torch.distributed as dist
    from megatron.core import parallel_state

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _gpt_model(lay: Layout, num_layers: int, pre_process: bool = True, post_process: bool = True):
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    # No CUDA calls need redirecting: with use_cpu_initialization=True, building (not running) the model stays on CPU.
    cfg = TransformerConfig(
        num_layers=num_layers, hidden_size=lay.hidden, num_attention_heads=lay.num_heads,
        num_query_groups=lay.num_kv_heads, kv_channels=lay.head_dim, ffn_hidden_size=lay.ffn, normalization="RMSNorm",
        layernorm_epsilon=1e-6, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=lay.qkv_bias, qk_layernorm=lay.qk_norm, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, use_cpu_initialization=True,
        params_dtype=torch.float32)
    spec = get_gpt_layer_local_spec(qk_layernorm=lay.qk_norm, normalization="RMSNorm")
    return GPTModel(cfg, transformer_layer_spec=spec, vocab_size=lay.vocab, max_sequence_length=2048,
                    position_embedding_type="rope", rotary_base=1e6, share_embeddings_and_output_weights=lay.tied,
                    pre_process=pre_process, post_process=post_process)


def _shapes(sd: dict) -> dict[str, tuple[int, ...]]:
    return {n: tuple(t.shape) for n, t in sd.items() if not n.endswith("_extra_state")}


@pytest.mark.parametrize("lay", [TINY, TINY_UNTIED, LLAMA_LIKE], ids=["tied", "untied", "llama_like"])
def test_matches_megatron_gpt_model(megatron_world_1, lay):
    hf = random_hf(lay)
    mc = shard_tp(hf_to_mcore(hf, lay), lay, 1, 0)
    model = _gpt_model(lay, lay.num_layers)
    assert _shapes(model.state_dict()) == _shapes(mc)
    result = model.load_state_dict(mc, strict=False)
    assert not result.unexpected_keys and all(k.endswith("_extra_state") for k in result.missing_keys)
    loaded = {n: t for n, t in model.state_dict().items() if not n.endswith("_extra_state")}
    assert_same(mcore_to_hf(loaded, lay), hf)
    # PP stages, each built as its own GPTModel (pre_process on the first, post_process on the last)
    lps = [1, 2] if lay.num_layers == 3 else None
    for r, layers in enumerate(stage_layers(lay, 2, lps)):
        stage = _gpt_model(lay, len(layers), pre_process=r == 0, post_process=r == 1)
        assert _shapes(stage.state_dict()) == _shapes(shard_pp(hf_to_mcore(hf, lay), lay, 2, r, lps))


@pytest.mark.parametrize("model_type", ["qwen3", "qwen2"])
def test_logits_match_hf_through_megatron(megatron_world_1, monkeypatch, model_type):
    # Running (not only building) GPTModel on CPU hits two CUDA calls, redirected for this test only: the rotary
    # embedding moves inv_freq to torch.cuda.current_device(), and attention always enters
    # get_cuda_rng_tracker().fork() (CUDA RNG state), even with dropout 0. An explicit causal mask avoids a third
    # (the default mask is allocated with device="cuda").
    from megatron.core import tensor_parallel

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(tensor_parallel.get_cuda_rng_tracker(), "fork", lambda *a, **k: contextlib.nullcontext())
    if model_type == "qwen3":
        hf_model = build_model("tiny", attn_implementation="eager")
    else:  # qkv bias, no qk norm, 4 q heads per kv group, untied
        hf_model = build_model(Qwen2Config(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
            vocab_size=128, tie_word_embeddings=False, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}), attn_implementation="eager")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norms init to 1 and biases to 0 would hide a swapped norm or bias
        for name, p in hf_model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
    lay = Layout.from_hf_config(hf_model.config)
    model = _gpt_model(lay, lay.num_layers).eval()
    mc = hf_to_mcore(hf_model.state_dict(), lay)
    ids = torch.randint(0, lay.vocab, (2, 12), generator=g)
    mask = torch.triu(torch.ones(12, 12, dtype=torch.bool), diagonal=1)[None, None]  # True = masked

    def logits(state):
        model.load_state_dict(state, strict=False)
        with torch.no_grad():
            return model(ids, torch.arange(12).expand(2, -1), attention_mask=mask)  # [B, T, V]

    with torch.no_grad():
        ref = hf_model(ids).logits  # [B, T, V]
    torch.testing.assert_close(logits(mc), ref, atol=1e-5, rtol=0)
    # negative control: HF-order cat([q, k, v]) in place of the group-major qkv
    q, k, v = (hf_model.state_dict()[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv")
    assert (logits(mc | {QKV: torch.cat([q, k, v])}) - ref).abs().max() > 1e-2
