"""A megatron-core GPTModel for a Hugging Face Qwen3 / Llama / Qwen2 config, with the HF weights in it.

The local layer spec (no TransformerEngine, apex or flash-attn) with rlbench's `CoreAttention` (packed THD
input) and HF's RMSNorm swapped in; every fusion off (the fused kernels need TE/apex). Weights come from the HF
directory (or a preset's random init, drawn exactly as the FSDP backend draws it), converted by `convert.py`
and cut to this rank's TP shard and PP stage.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, PretrainedConfig

from rlbench.backends.megatron import convert
from rlbench.configs.backend import TrainConfig
from rlbench.configs.megatron import MegatronConfig


def transformer_config(hf: PretrainedConfig, mcfg: MegatronConfig, fcfg: TrainConfig):
    """megatron's `TransformerConfig` for the HF architecture, the layout of `mcfg` and the dtype of `fcfg`."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    layout = convert.Layout.from_hf_config(hf)
    dtype = fcfg.torch_param_dtype
    recompute = {}
    if mcfg.recompute_granularity is not None:
        recompute["recompute_granularity"] = mcfg.recompute_granularity
    if mcfg.recompute_granularity == "full":
        recompute["recompute_method"] = mcfg.recompute_method or "uniform"
        recompute["recompute_num_layers"] = mcfg.recompute_num_layers or (
            1 if recompute["recompute_method"] == "uniform" else layout.num_layers // mcfg.pipeline_model_parallel_size)
    cfg = TransformerConfig(
        num_layers=layout.num_layers, hidden_size=layout.hidden, num_attention_heads=layout.num_heads,
        num_query_groups=layout.num_kv_heads, kv_channels=layout.head_dim, ffn_hidden_size=layout.ffn,
        normalization="RMSNorm", layernorm_epsilon=hf.rms_norm_eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=layout.qkv_bias, qk_layernorm=layout.qk_norm,
        hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=mcfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=mcfg.pipeline_model_parallel_size,
        sequence_parallel=mcfg.sequence_parallel, variable_seq_lengths=mcfg.pipeline_model_parallel_size > 1,
        # a dense model dispatches no MoE tokens, but megatron's config check refuses variable sequence lengths
        # (PP with packs of different lengths) under its default "allgather" dispatcher
        moe_token_dispatcher_type="alltoall",
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        pipeline_dtype=dtype, autocast_dtype=dtype,
        # losses are global weighted sums (rlbench.algorithms): no division by micro-batch or token counts, and
        # the DP gradient reduction is a sum
        calculate_per_token_loss=True,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        use_cpu_initialization=True, perform_initialization=False, **recompute,
    )
    cfg.rlbench_attention = mcfg.core_attention(fcfg.device)  # read by layers.CoreAttention
    return cfg


def layer_spec(hf: PretrainedConfig):
    """The local spec with rlbench's core attention and HF's RMSNorm."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from rlbench.backends.megatron.layers import CoreAttention, RMSNorm

    layout = convert.Layout.from_hf_config(hf)
    spec = get_gpt_layer_local_spec(qk_layernorm=layout.qk_norm, normalization="RMSNorm")
    sub = spec.submodules
    sub.self_attention.submodules.core_attention = CoreAttention
    sub.input_layernorm = sub.pre_mlp_layernorm = RMSNorm
    if layout.qk_norm:
        sub.self_attention.submodules.q_layernorm = sub.self_attention.submodules.k_layernorm = RMSNorm
    return spec


def build_gpt(hf: PretrainedConfig, config, device: torch.device):
    """This rank's GPTModel (its PP stage, TP-sharded), uninitialised, on `device`."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    from rlbench.backends.megatron.layers import RMSNorm

    rope = getattr(hf, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(hf, "rope_theta", 10_000.0))
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope_type={rope.get('rope_type')!r}: the megatron backend maps default RoPE only; use "
                         "the FSDP backend for scaled RoPE")
    # the block spec names the final norm too (the layer spec alone would give it megatron's torch norm)
    block = TransformerBlockSubmodules(layer_specs=[layer_spec(hf)] * get_num_layers_to_build(config),
                                       layer_norm=RMSNorm)
    model = GPTModel(
        config, transformer_layer_spec=block, vocab_size=hf.vocab_size,
        max_sequence_length=hf.max_position_embeddings, pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(), parallel_output=True,
        share_embeddings_and_output_weights=bool(hf.tie_word_embeddings), position_embedding_type="rope",
        rotary_base=int(theta),
    )
    # megatron marks its split weights (which the grad norm counts once per TP rank) in its init functions,
    # which perform_initialization=False skips before megatron-core 0.19: mark the unmarked ones here from the
    # converter's layout table (and check megatron's own marks agree with it)
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    for name, param in model.named_parameters():
        dim = convert.tp_partition_dim(name)
        if dim is None:
            continue
        if getattr(param, "tensor_model_parallel", False):
            if param.partition_dim != dim:
                raise RuntimeError(f"megatron splits {name} on dim {param.partition_dim}, the converter on {dim}")
        else:
            for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
                if hasattr(param, attr):
                    delattr(param, attr)
            set_tensor_model_parallel_attributes(param, True, dim, 1)
    return model.to(device)


def hf_state_dict(name: str, fcfg: TrainConfig, device: torch.device) -> tuple[dict, PretrainedConfig]:
    """The full HF state dict of a model directory, or a preset's random init drawn as the FSDP backend draws it
    (`rlbench.backends.hf_weights.random_init`, same seed), so both backends start from the same weights."""
    from rlbench.backends.hf_weights import load_hf_weights, model_config, random_init
    from rlbench.models.build import params_on_meta

    hf = model_config(name, fcfg.model_overrides)
    with params_on_meta():
        model = AutoModelForCausalLM.from_config(hf, dtype=torch.float32)
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives the tied lm_head its own storage; tie it back before loading
    if os.path.isdir(name):
        load_hf_weights(model, name)
    else:
        random_init(model, hf, fcfg.seed, device)
    state = {k: v for k, v in model.state_dict().items() if not (hf.tie_word_embeddings and k == "lm_head.weight")}
    state = {k: v for k, v in state.items() if "rotary_emb" not in k}
    return state, hf


@torch.no_grad()
def load_into(model, hf_state: dict, hf: PretrainedConfig) -> None:
    """Copy the HF weights into this rank's (TP shard, PP stage) GPTModel, checking every name and shape."""
    from megatron.core import parallel_state as ps

    layout = convert.Layout.from_hf_config(hf)
    full = convert.hf_to_mcore(hf_state, layout)
    stage = convert.shard_pp(full, layout, ps.get_pipeline_model_parallel_world_size(),
                             ps.get_pipeline_model_parallel_rank())
    local = convert.shard_tp(stage, layout, ps.get_tensor_model_parallel_world_size(),
                             ps.get_tensor_model_parallel_rank())
    targets = {k: v for k, v in model.state_dict(keep_vars=True).items() if not k.endswith("_extra_state")}
    missing, extra = sorted(set(targets) - set(local)), sorted(set(local) - set(targets))
    if missing or extra:
        raise ValueError(f"megatron model and converted weights disagree: missing {missing[:4]}, unexpected "
                         f"{extra[:4]}; is the HF config the model's?")
    for name, param in targets.items():
        src = local[name]
        if tuple(src.shape) != tuple(param.shape):
            raise ValueError(f"{name}: converted shape {tuple(src.shape)} != megatron's {tuple(param.shape)}")
        param.data.copy_(src.to(param.dtype))
