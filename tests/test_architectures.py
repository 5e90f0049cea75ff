"""Every architecture is correct or refused (docs/architectures.md): tiny random models built from transformers' own
config classes, fp32, run through the engine, the packed training forward, the Trainer and true on-policy mode.

Per row: the engine's greedy tokens equal HF `generate` token for token and its log-probs HF's forward within 1e-5;
the packed forward equals each sequence's own forward, per attention implementation (or the trainer refuses that
implementation by name); one GRPO step through the Trainer (in true on-policy mode with a diff of exactly 0.0, or
the mode's one-line refusal). Sliding windows are short enough to bind, sinks and soft-caps large enough to move the
log-probs (`test_each_feature_moves_the_logprobs` shows the comparisons fail without them).
"""

from __future__ import annotations

import copy
import dataclasses
import re

import pytest
import torch
import transformers as tf

from rlbench.backends.attention import packed_attention_mask
from rlbench.engine import SamplingParams, TorchEngine, TorchEngineConfig, attention_extras
from rlbench.models.capabilities import (
    TORCH_ENGINE,
    TRUE_ON_POLICY,
    check_model,
    model_features,
    trainer,
)

VOCAB = 128  # rlbench.data.build_tokenizer()'s size
WINDOW = 5
"""Sliding window of the rows that have one: prompts and responses here are longer, so it binds."""
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=0,
              bos_token_id=1, eos_token_id=2)
TWO_TYPES = ["sliding_attention", "full_attention"]


def _config(name: str):
    c = dict(COMMON)
    if name == "qwen3":
        return tf.Qwen3Config(**c, head_dim=8)
    if name == "qwen2":
        return tf.Qwen2Config(**c)
    if name == "llama":
        return tf.LlamaConfig(**c)
    if name == "phi3":
        return tf.Phi3Config(**c)
    if name == "olmo2":
        return tf.Olmo2Config(**c)
    if name == "mistral":
        return tf.MistralConfig(**c, head_dim=8, sliding_window=WINDOW)
    if name == "mistral-wide":  # the default 4096 window: longer than every sequence, so plain causal attention
        return tf.MistralConfig(**c, head_dim=8)
    if name == "gemma2":
        return tf.Gemma2Config(**c, head_dim=8, sliding_window=WINDOW, query_pre_attn_scalar=8,
                               attn_logit_softcapping=2.0, final_logit_softcapping=3.0, layer_types=TWO_TYPES)
    if name == "gemma3":
        return tf.Gemma3TextConfig(**c, head_dim=8, sliding_window=WINDOW, query_pre_attn_scalar=8,
                                   layer_types=TWO_TYPES)
    if name == "gpt_oss":
        return tf.GptOssConfig(**c, head_dim=8, sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2,
                               layer_types=TWO_TYPES)
    raise KeyError(name)


DENSE = ["qwen3", "qwen2", "llama", "phi3", "olmo2", "mistral", "mistral-wide", "gemma2", "gemma3", "gpt_oss"]
MOE: list[str] = []
"""MoE rows (Qwen3-MoE, Mixtral): checkpoint loading/export and the engine's MoE path add their rows here."""
ROWS = DENSE + MOE
EAGER_ONLY = {"gemma2", "gpt_oss"}
"""Rows whose attention (soft-capping, sinks) sdpa lacks: the trainer runs them with attn_implementation='eager'."""
TRUE_ON_POLICY_ROWS = ["qwen3", "qwen2", "llama", "phi3", "olmo2", "mistral-wide"]
TRUE_ON_POLICY_REFUSED = {
    "mistral": "sliding-window attention (window 5 < max_seq_len=48)",
    "gemma2": "sliding-window attention",
    "gemma3": "sliding-window attention",
    "gpt_oss": "sliding-window attention",
}


def _model(name: str, attn: str = "eager"):
    """The row's model, 2-D weights x4 (decisive logits: greedy has no near-ties), gpt-oss sinks ~ N(0, 1)."""
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(_config(name), attn_implementation=attn, dtype=torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() >= 2:
                p.mul_(4)
            elif pname.endswith("sinks"):
                p.normal_(0, 1)
    return model.eval()


PROMPTS = [[5, 9, 3, 7, 2, 8, 4, 6, 10, 11, 12, 13], [3, 4, 5], [7, 7, 7, 7, 7, 7, 7, 7, 9]]
NEW = 12


def _response_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0]
    return torch.log_softmax(logits.float(), -1)[len(prompt) - 1 : -1].gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def _engine(model, **kw):
    return TorchEngine(copy.deepcopy(model), TorchEngineConfig(**{"max_seq_len": 48, "num_slots": 6, **kw}))


@pytest.mark.parametrize("name", ROWS)
def test_engine_greedy_equals_hf_generate(name, one_thread):
    """Token for token against `generate`; log-probs against HF's forward of the whole sequence within 1e-5."""
    model = _model(name)
    gens = _engine(model).generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=NEW))
    for prompt, g in zip(PROMPTS, gens):
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(prompt):].tolist()
        assert g.token_ids == ref, f"{name}: engine {g.token_ids} != HF {ref}"
        diff = (_response_logprobs(model, prompt, g.token_ids) - torch.tensor(g.log_probs)).abs().max().item()
        assert diff <= 1e-5, f"{name}: max |log-prob diff| {diff:.2e}"


@pytest.mark.parametrize("name", ["mistral", "gemma2", "gemma3", "gpt_oss"])
def test_shared_prefix_and_sessions_keep_the_window(name, one_thread):
    """The grouped layout (n samples reading one prompt copy: index != position) samples what the slot layout does,
    and a session's next turn (`continue_`: an extend into the cached slot) equals a fresh greedy prompt."""
    model = _model(name)
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW, n=2, seed=3)
    grouped = _engine(model, shared_prefix=True).generate(PROMPTS[:2], params)
    slots = _engine(model, shared_prefix=False).generate(PROMPTS[:2], params)
    assert [g.token_ids for g in grouped] == [g.token_ids for g in slots]
    for a, b in zip(grouped, slots):
        assert max(abs(x - y) for x, y in zip(a.log_probs, b.log_probs)) <= 1e-5
    engine, greedy = _engine(model), SamplingParams(temperature=0.0, max_new_tokens=6)
    first = engine.generate([PROMPTS[0]], greedy, keep=True)[0]
    observation = [20, 21, 22, 23, 24, 25, 26]
    turn = engine.continue_([first.session], [observation], greedy)[0]
    fresh = _engine(model).generate([PROMPTS[0] + first.token_ids + observation], greedy)[0]
    assert turn.token_ids == fresh.token_ids


@pytest.mark.parametrize("feature", ["window", "softcap", "sinks", "final_softcap", "layer_rope"])
def test_each_feature_moves_the_logprobs(feature, monkeypatch, one_thread):
    """Negative controls: the engine without one feature is off HF by far more than the 1e-5 the rows assert."""
    name = {"window": "mistral", "softcap": "gemma2", "sinks": "gpt_oss", "final_softcap": "gemma2",
            "layer_rope": "gemma3"}[feature]
    model = _model(name)
    engine = _engine(model)
    if feature in ("window", "softcap", "sinks"):
        full = attention_extras.Extras.of

        def without(kwargs, cache_len):
            ex = full(kwargs, cache_len)
            return None if ex is None else dataclasses.replace(ex, **{feature: None})

        monkeypatch.setattr(attention_extras.Extras, "of", staticmethod(without))
    elif feature == "final_softcap":
        engine.runner.final_softcap = None
    else:  # every layer reads the first (global) table
        engine.runner.rope_index = [0] * len(engine.runner.rope_index)
    g = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_new_tokens=NEW))[0]
    diff = (_response_logprobs(model, PROMPTS[0], g.token_ids) - torch.tensor(g.log_probs)).abs().max().item()
    assert diff > 1e-3, f"{name} without {feature}: diff {diff:.2e}"


SEQS = [[5, 9, 3, 7, 2, 8, 4, 6, 10, 11, 12, 13, 14, 15], [3, 4, 5, 6, 7, 8, 9], [20, 21, 22, 23, 24, 25, 26, 27, 28]]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", ROWS)
def test_packed_forward_equals_per_sequence(name, attn, one_thread):
    """The trainer's packed forward (one row, positions restarting per sequence, no cache, the trainer's masks)
    equals each sequence's forward alone, with every attention implementation the trainer accepts for the row; the
    others are refused. (gpt-oss builds its masks without the position ids: without ours its samples see each
    other, `test_gpt_oss_packed_rows_leak_without_the_trainer_masks`.)"""
    feats = model_features(_config(name))
    if name in EAGER_ONLY and attn == "sdpa":
        what = "soft-capping" if name == "gemma2" else "attention sinks"
        with pytest.raises(ValueError, match=f"attn_implementation='sdpa' has no {what}; use --attn-implementation"):
            check_model(_config(name), trainer(attn), max_seq_len=None)
        return
    check_model(_config(name), trainer(attn), max_seq_len=None)
    model = _model(name, attn)
    tokens = torch.tensor([t for s in SEQS for t in s])[None]
    positions = torch.cat([torch.arange(len(s)) for s in SEQS])[None]
    mask = packed_attention_mask(positions[0], attn, feats, torch.float32)  # as FSDPBackend.pack_inputs passes it
    with torch.no_grad():
        packed = model(input_ids=tokens, position_ids=positions, attention_mask=mask, use_cache=False).logits[0]
        alone = torch.cat([model(input_ids=torch.tensor([s]), use_cache=False).logits[0] for s in SEQS])
    assert (packed - alone).abs().max().item() <= 1e-5 * max(1.0, alone.abs().max().item())
    assert any(feats.windows) == (name in ("mistral", "gemma2", "gemma3", "gpt_oss", "mistral-wide"))


def test_gpt_oss_packed_rows_leak_without_the_trainer_masks(one_thread):
    """The reason the trainer passes gpt-oss its masks: transformers' own (no position ids) let samples mix."""
    model = _model("gpt_oss")
    tokens = torch.tensor([t for s in SEQS for t in s])[None]
    positions = torch.cat([torch.arange(len(s)) for s in SEQS])[None]
    with torch.no_grad():
        packed = model(input_ids=tokens, position_ids=positions, use_cache=False).logits[0]
        alone = torch.cat([model(input_ids=torch.tensor([s]), use_cache=False).logits[0] for s in SEQS])
    assert (packed - alone).abs().max().item() > 1e-2


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """name -> a saved HF directory of the row's model with the char tokenizer (built on first use)."""
    from rlbench.data import build_tokenizer

    made: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in made:
            path = str(tmp_path_factory.mktemp(name))
            _model(name).save_pretrained(path)
            build_tokenizer(VOCAB).save_pretrained(path)
            made[name] = path
        return made[name]

    return get


def _run_config(path: str, workdir: str, name: str, on_policy: bool):
    from dataclasses import replace

    from rlbench import presets
    from rlbench.configs import EvalConfig

    cfg = presets.cpu_test(model=path, workdir=workdir, level=1, n_eval=4)
    fsdp = replace(cfg.backend.fsdp, attn_implementation="eager" if name in EAGER_ONLY else None)
    return cfg.replace(
        true_on_policy_mode=on_policy, eval=EvalConfig(), data=replace(cfg.data, metadata_key=None),
        rollout=replace(cfg.rollout, rm_type="chars", rollout_batch_size=2, n_samples_per_prompt=4, max_response_len=8),
        batch=replace(cfg.batch, global_batch_size=8, num_rollout=1), backend=replace(cfg.backend, fsdp=fsdp))


def _char_reward(response: str, label) -> float:
    return (sum(map(ord, response)) % 7) / 6


@pytest.mark.parametrize("name", ROWS)
def test_grpo_step_through_the_trainer(name, hf_dirs, tmp_path, monkeypatch, one_thread):
    """One GRPO step from the row's HF directory: in true on-policy mode with a rollout/trainer log-prob diff of
    exactly 0.0 where the mode covers the architecture (else its one-line refusal, and the step in the default mode,
    whose diff is the fp32 noise between the engine and the trainer's packed forward)."""
    from rlbench import Trainer
    from rlbench.rewards import REWARDS

    monkeypatch.setitem(REWARDS, "chars", _char_reward)
    on_policy = name in TRUE_ON_POLICY_ROWS
    if not on_policy:
        with pytest.raises(ValueError, match=re.escape(TRUE_ON_POLICY_REFUSED[name]) + ".*: true on-policy mode "
                                              "does not implement it; the batch-invariant ops"):
            Trainer(_run_config(hf_dirs(name), str(tmp_path / "top"), name, True))
    m = Trainer(_run_config(hf_dirs(name), str(tmp_path), name, on_policy)).step()
    assert m["train/grad_norm"] > 0 and torch.isfinite(torch.tensor(m["train/pg_loss"]))
    diff = m["train/train_rollout_logprob_abs_diff"]
    assert diff == 0.0 if on_policy else diff <= 1e-5, f"{name}: diff {diff}"


# ---------------------------------------------------------------- refused architectures
def _qwen3_next():
    return tf.Qwen3NextConfig(**{**COMMON, "num_hidden_layers": 4}, head_dim=8, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=16, shared_expert_intermediate_size=16)


def _qwen2_5_vl():
    return tf.Qwen2_5_VLConfig(text_config=dict(COMMON), vision_config=dict(depth=1, hidden_size=16, num_heads=2,
                                                                             out_hidden_size=32))


def test_refused_architectures_name_the_feature_and_the_option():
    expected = ("qwen3_next layer types ['linear_attention'] (hybrid linear attention): the torch engine does not "
                "implement it; the torch engine keeps no recurrent state per sequence yet; use --rollout-engine sglang")
    with pytest.raises(ValueError, match=re.escape(expected)) as err:
        check_model(_qwen3_next(), TORCH_ENGINE, max_seq_len=2048)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="no rlbench trainer runs these layers yet"):
        check_model(_qwen3_next(), trainer("sdpa"), max_seq_len=None)


def test_a_vlm_runs_on_the_torch_engine_and_is_refused_where_not_implemented():
    """Qwen2.5-VL (tests/test_vlm_*.py): the torch engine and the FSDP trainer take it; SGLang's adapter, megatron,
    context parallelism and true on-policy mode refuse it by name."""
    from rlbench.models.capabilities import MEGATRON, SGLANG_ENGINE

    check_model(_qwen2_5_vl(), TORCH_ENGINE, max_seq_len=2048)
    for consumer, text in [(SGLANG_ENGINE, "the SGLang engine adapter does not implement it; the SGLang adapter "
                                           "passes token ids only"),
                           (MEGATRON, "the megatron backend does not implement it"),
                           (trainer("sdpa", cp_size=2), "the FSDP trainer (context_parallel_size=2) does not "
                                                        "implement it"),
                           (TRUE_ON_POLICY, "true on-policy mode does not implement it")]:
        with pytest.raises(ValueError, match=re.escape("qwen2_5_vl a vision tower (VLM): " + text)):
            check_model(_qwen2_5_vl(), consumer, max_seq_len=2048)


def test_a_qwen3_next_engine_is_refused_at_build(one_thread):
    model = tf.AutoModelForCausalLM.from_config(_qwen3_next(), dtype=torch.float32)
    with pytest.raises(ValueError, match="linear_attention.*use --rollout-engine sglang"):
        TorchEngine(model, TorchEngineConfig(max_seq_len=32, num_slots=2))


def test_a_window_longer_than_every_sequence_is_not_refused():
    """Mistral's default window (4096) cuts nothing at max_seq_len 2048: true on-policy mode takes it; at 8192 it
    binds and is refused."""
    config = _config("mistral-wide")
    check_model(config, TRUE_ON_POLICY, max_seq_len=2048)
    with pytest.raises(ValueError, match=r"mistral sliding-window attention \(window 4096 < max_seq_len=8192\)"):
        check_model(config, TRUE_ON_POLICY, max_seq_len=8192)


# ---------------------------------------------------------------- CUDA: the compiled engine and flex_attention

@pytest.mark.parametrize("name", ["qwen3", "phi3", "mistral", "gemma2", "gemma3", "gpt_oss"])
@pytest.mark.parametrize("shared_prefix", [False, True], ids=["slots", "grouped"])
@pytest.mark.usefixtures("no_tf32")
@pytest.mark.gpu
def test_compiled_cuda_engine_equals_hf(name, shared_prefix):
    """The compiled, CUDA-graph-captured decode step (one layer graph, RoPE tables per layer type in the prologue,
    the window/soft-cap/sink attention inside the graph) against HF eager on the same GPU, fp32."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = _model(name).cuda()
    engine = TorchEngine(copy.deepcopy(model), TorchEngineConfig(max_seq_len=48, num_slots=8,
                                                                 shared_prefix=shared_prefix))
    gens = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=NEW, n=2))
    for g in gens:
        prompt = PROMPTS[g.prompt_index]
        ref = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=NEW, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert g.token_ids == ref, f"{name}: engine {g.token_ids} != HF {ref}"
        with torch.no_grad():
            logits = model(torch.tensor([prompt + g.token_ids], device="cuda")).logits[0].float()
        picked = torch.tensor(g.token_ids, device="cuda")[:, None]
        lp = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(-1, picked)[:, 0].cpu()
        assert (lp - torch.tensor(g.log_probs)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name", ["mistral", "gemma2", "gemma3", "gpt_oss"])
@pytest.mark.usefixtures("no_tf32")
@pytest.mark.gpu
def test_flex_packed_forward_equals_per_sequence_cuda(name):
    """flex_attention with the trainer's masks (per layer type: rlbench's windowed document BlockMasks; Mistral:
    transformers' own) against each sequence alone (eager), fp32 on CUDA."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    feats = model_features(_config(name))
    check_model(_config(name), trainer("flex_attention"), max_seq_len=None)
    flex, eager = _model(name, "flex_attention").cuda(), _model(name, "eager").cuda()
    tokens = torch.tensor([t for s in SEQS for t in s], device="cuda")[None]
    positions = torch.cat([torch.arange(len(s)) for s in SEQS]).cuda()[None]
    mask = packed_attention_mask(positions[0], "flex_attention", feats, torch.float32)
    with torch.no_grad():
        packed = flex(input_ids=tokens, position_ids=positions, attention_mask=mask, use_cache=False).logits[0]
        alone = torch.cat([eager(input_ids=torch.tensor([s], device="cuda"), use_cache=False).logits[0] for s in SEQS])
    assert (packed - alone).abs().max().item() <= 1e-4 * max(1.0, alone.abs().max().item())
