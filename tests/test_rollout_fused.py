"""The engine's own decode path on CPU: fused-weight layers vs HF, decode attention vs float64, per-layer compile."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from rlbench.engine import SamplingParams, TorchEngine, TorchEngineConfig
from rlbench.engine.attention import DECODE_ATTENTION_FNS, decode_mask
from rlbench.engine.runner import ModelRunner
from rlbench.models import build_model

_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, tie_word_embeddings=False)


pytestmark = pytest.mark.usefixtures("one_thread")


def _arch(name: str, seed: int = 0, **overrides):
    """A tiny random model of one architecture family (Qwen3 has q/k-norm, Qwen2 qkv bias, Llama neither)."""
    if name == "qwen3":
        return build_model("tiny", seed=seed, **overrides)
    cfg = (Qwen2Config if name == "qwen2" else LlamaConfig)(**_SMALL, **overrides)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")


def _prompts(lengths=(3, 7, 12, 5, 9), seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in lengths]


def _engine(model, **cfg):
    return TorchEngine(model, TorchEngineConfig(max_seq_len=96, num_slots=4, steps_per_sync=4, **cfg))


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_fused_layers_equal_hf_forward(arch):
    """Prefill logits of the fused path == the HF forward of the same weights (fp32); greedy == HF greedy."""
    engine, ref = _engine(_arch(arch)), _arch(arch)
    assert engine.runner.fused
    assert (ref.model.layers[0].self_attn.q_proj.bias is not None) == (arch == "qwen2")
    prompts = _prompts()
    got = engine.runner.prefill(prompts[:4], [0, 1, 2, 3])
    with torch.no_grad():
        want = torch.stack([ref(torch.tensor([p])).logits[0, -1] for p in prompts[:4]])
    diff = (got - want).abs().max().item()
    print(f"{arch}: fused vs HF fp32 logits max |diff| {diff:.2e}")
    assert diff < 1e-5
    out = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=12))
    for p, g in zip(prompts, out):
        hf = ref.generate(torch.tensor([p]), do_sample=False, max_new_tokens=12, min_new_tokens=12, pad_token_id=0)
        assert g.token_ids == hf[0, len(p):].tolist()


def test_fused_tensors_own_the_hf_weights():
    """q/k/v and gate/up are views of the fused tensors: loading an HF-named tensor writes the fused storage."""
    engine = _engine(_arch("qwen3"))
    layer, attn = engine.runner.layers[1], engine.model.model.layers[1].self_attn
    q = attn.q_proj.weight.shape[0]
    assert attn.q_proj.weight.data_ptr() == layer.qkv.data_ptr()
    assert attn.k_proj.weight.data_ptr() == layer.qkv[q:].data_ptr()
    new_k = torch.randn_like(attn.k_proj.weight)
    new_up = torch.randn_like(engine.model.model.layers[1].mlp.up_proj.weight)
    engine.update_weights([[("model.layers.1.self_attn.k_proj.weight", new_k),
                            ("model.layers.1.mlp.up_proj.weight", new_up)]], version=1)
    assert torch.equal(layer.qkv[q : q + new_k.shape[0]], new_k)
    assert torch.equal(layer.gate_up[new_up.shape[0]:], new_up)
    engine.sleep(release_weights=True)
    assert engine.runner.layers == []
    engine.wake_up()
    assert engine.model.model.layers[1].self_attn.k_proj.weight.data_ptr() == engine.runner.layers[1].qkv[q:].data_ptr()


def test_hf_layer_fallback():
    """`fused_weights=False`, or an architecture outside `FUSABLE` (here a GELU MLP), runs the HF layers."""
    sampling = SamplingParams(temperature=0.0, max_new_tokens=10)
    for model, cfg in [(_arch("qwen3"), dict(fused_weights=False)), (_arch("qwen3", hidden_act="gelu"), {})]:
        engine, ref = _engine(model, **cfg), _arch("qwen3", **({} if cfg else dict(hidden_act="gelu")))
        assert not engine.runner.fused
        for p, g in zip(_prompts(), engine.generate(_prompts(), sampling)):
            hf = ref.generate(torch.tensor([p]), do_sample=False, max_new_tokens=10, min_new_tokens=10, pad_token_id=0)
            assert g.token_ids == hf[0, len(p):].tolist()


def _reference_attention(q, keys, values, mask, scale):
    """Float64 masked attention: q `[B, n_kv, G, hd]`, keys/values `[B, n_kv, L, hd]`, mask `[B, 1, 1, L]`."""
    scores = torch.einsum("bkgd,bkld->bkgl", q.double(), keys.double()) * scale
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("bkgl,bkld->bkgd", probs, values.double())


@pytest.mark.parametrize("impl", sorted(DECODE_ATTENTION_FNS))
@pytest.mark.parametrize("kv_len", [16, 96, 256])
def test_decode_attention_equals_float64_reference(impl, kv_len):
    """GQA (4 query heads per KV head), strided cache slices, positions leaving masked tails of every length."""
    g = torch.Generator().manual_seed(kv_len)
    b, n_kv, groups, hd = 5, 2, 4, 32
    cache_k, cache_v = (torch.randn(8, n_kv, kv_len + 16, hd, generator=g) for _ in range(2))
    keys, values = cache_k[:b, :, :kv_len], cache_v[:b, :, :kv_len]  # strided, like the engine's slices
    q = torch.randn(b, n_kv, groups, hd, generator=g)
    positions = torch.tensor([0, kv_len - 1, kv_len // 2, 3, kv_len - 7])
    mask = decode_mask(positions, kv_len)
    got = DECODE_ATTENTION_FNS[impl](q, keys, values, mask, hd**-0.5)
    want = _reference_attention(q, keys, values, mask, hd**-0.5)
    assert got.shape == (b, n_kv, groups, hd) and got.dtype == torch.float32
    assert (got.double() - want).abs().max() < 2e-6
    assert torch.allclose(got[0].double(), values[0, :, :1].double().expand(n_kv, groups, hd))  # position 0


class _CountingBackend:
    """A torch.compile backend that records every graph dynamo hands it and runs it eagerly."""

    def __init__(self):
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def placeholders(self, i: int) -> list[str]:
        return [n.name for n in self.graphs[i].graph.nodes if n.op == "placeholder"]


@pytest.mark.parametrize("fused", [True, False])
def test_one_layer_graph_serves_every_layer_and_bucket(fused):
    """Compiled (counting backend): prologue + ONE layer graph + head per mode, for 2 layers x 9 (batch, kv_len)
    buckets incl. b == num_slots and kv_len == max_seq_len, and one more prologue + layer graph for the grouped
    layout (n > 1) whatever its buckets; results == the eager engine's."""
    backend = _CountingBackend()
    before = counters["stats"]["unique_graphs"]
    engine, eager = _engine(_arch("qwen3"), fused_weights=fused), _engine(_arch("qwen3"), fused_weights=fused)
    engine.runner = ModelRunner(engine.model, engine.cache, TorchEngineConfig(compile=True, cuda_graphs=False,
                                                                              fused_weights=fused, gemv_batch1=False),
                                compile_backend=backend)
    for b in (2, 4):
        for kv in (32, 64, 96):
            engine.runner.decode(b, kv, "sample")
    assert len(backend.graphs) == 3, [g.code for g in backend.graphs]
    layer_inputs = backend.placeholders(1)
    assert any("k_cache" in n for n in layer_inputs) and not any("layers_0" in n for n in layer_inputs)
    sampling = SamplingParams(temperature=0.8, max_new_tokens=12, n=2, seed=5)
    got, want = engine.generate(_prompts(), sampling), eager.generate(_prompts(), sampling)
    assert [g.token_ids for g in got] == [g.token_ids for g in want]
    diff = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g.log_probs, w.log_probs))
    assert diff < 1e-5  # compiled: "split" attention; eager: "sdpa"
    assert len(backend.graphs) == 5  # n = 2 shares each prompt: + ONE grouped prologue and layer graph for its buckets
    greedy = engine.generate(_prompts(), SamplingParams(temperature=0.0, max_new_tokens=6))
    assert [g.token_ids for g in greedy] == [g.token_ids for g in eager.generate(_prompts(), SamplingParams(
        temperature=0.0, max_new_tokens=6))]
    assert len(backend.graphs) == 6  # + the greedy head (n = 1: the slot layout's graphs)
    assert counters["stats"]["unique_graphs"] - before == 6


def test_auto_attention_compiles_one_layer_graph_per_side():
    """decode_attention="auto": batches on either side of SPLIT_MAX_BLOCKS compile the layer once per side (a
    guard, not a graph per batch); each side equals the eager engine (sdpa) for the same slots."""
    from rlbench.engine.attention import SPLIT_MAX_BLOCKS

    backend = _CountingBackend()
    model = _arch("qwen3")
    n_kv = model.config.num_key_value_heads
    engine = TorchEngine(model, TorchEngineConfig(max_seq_len=48, num_slots=64, decode_attention="auto"))
    eager = TorchEngine(_arch("qwen3"), TorchEngineConfig(max_seq_len=48, num_slots=64))
    engine.runner = ModelRunner(engine.model, engine.cache, TorchEngineConfig(compile=True, cuda_graphs=False,
                                                                              gemv_batch1=False),
                                compile_backend=backend)
    small, large = 2, 2 * SPLIT_MAX_BLOCKS // n_kv  # b * n_kv below / above the threshold
    for b in (small, large, small * 2, large // 2):
        engine.runner.decode(b, 32, "greedy")
    layer_graphs = [g for g in backend.graphs if any("k_cache" in n for n in [p.name for p in g.graph.nodes
                                                                               if p.op == "placeholder"])]
    assert len(layer_graphs) == 2 and len(backend.graphs) == 4  # prologue + 2 layer graphs + head
    prompts = _prompts(lengths=[3 + i % 11 for i in range(large)])
    sampling = SamplingParams(temperature=0.0, max_new_tokens=5)
    for batch in (prompts[:small], prompts):
        assert [g.token_ids for g in engine.generate(batch, sampling)] == \
            [g.token_ids for g in eager.generate(batch, sampling)]


def test_gemv_batch1_adds_one_batch1_graph_set():
    """`gemv_batch1`: batch 1 is a bucket and specialises once (prologue, layer, head); other batches reuse."""
    backend = _CountingBackend()
    engine = _engine(_arch("qwen3"))
    engine.runner = ModelRunner(engine.model, engine.cache, TorchEngineConfig(compile=True, cuda_graphs=False,
                                                                              gemv_batch1=True),
                                compile_backend=backend)
    assert engine.runner.min_batch == 1
    for b in (1, 2, 4, 1):
        engine.runner.decode(b, 32, "greedy")
    assert len(backend.graphs) == 6
    eager = _engine(_arch("qwen3"))
    sampling = SamplingParams(temperature=0.0, max_new_tokens=8)
    assert [g.token_ids for g in engine.generate(_prompts()[:1], sampling)] == \
        [g.token_ids for g in eager.generate(_prompts()[:1], sampling)]


def test_config_errors():
    with pytest.raises(ValueError, match="decode_attention"):
        TorchEngineConfig(decode_attention="flash")


def test_a_failed_decode_compile_falls_back_for_that_shape_only():
    """A decode shape whose compile fails decodes eagerly, said with its shape; the other shapes stay compiled; a
    second failing shape turns compile off everywhere (a compile that fails everywhere costs its time once more)."""

    class FailingBackend(_CountingBackend):
        def __init__(self, batches):
            super().__init__()
            self.batches = batches

        def __call__(self, gm, example_inputs):
            if any(isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[0] in self.batches for t in example_inputs):
                raise RuntimeError("injected compile failure")
            return super().__call__(gm, example_inputs)

    torch._dynamo.reset()  # no layer graph cached by an earlier test: the first decode compiles
    engine, eager = _engine(_arch("qwen3")), _engine(_arch("qwen3"))
    backend = FailingBackend({4})
    engine.runner = ModelRunner(engine.model, engine.cache, TorchEngineConfig(compile=True, cuda_graphs=False,
                                                                              gemv_batch1=False),
                                compile_backend=backend)
    with pytest.warns(UserWarning, match="failed at batch 4, kv_len 32.*this shape decodes without compile"):
        engine.runner.decode(4, 32, "greedy")
    assert engine.runner.compiled and engine.runner._eager_keys == {(4, 32, "greedy", 1)}
    compiled_before = len(backend.graphs)
    engine.runner.decode(2, 32, "greedy")  # another shape compiles
    assert engine.runner.compiled and len(backend.graphs) > compiled_before
    sampling = SamplingParams(temperature=0.0, max_new_tokens=6)
    prompts = _prompts(lengths=(3, 7, 12, 5))
    for batch in (prompts[:2], prompts):  # batch 2 compiled, batch 4 eager: the eager engine's tokens
        assert [g.token_ids for g in engine.generate(batch, sampling)] == \
            [g.token_ids for g in eager.generate(batch, sampling)]
    torch._dynamo.reset()  # a fresh runner whose compiles fail at two shapes (dynamic: each new graph compiles once)
    engine.runner = ModelRunner(engine.model, engine.cache, TorchEngineConfig(compile=True, cuda_graphs=False,
                                                                              gemv_batch1=False),
                                compile_backend=FailingBackend({2, 4}))
    with pytest.warns(UserWarning, match="this shape decodes without compile"):
        engine.runner.decode(4, 32, "greedy")
    with pytest.warns(UserWarning, match="decoding every shape without compile"):
        engine.runner.decode(2, 32, "greedy")
    assert not engine.runner.compiled
