"""Training a tiny random Qwen2.5-VL: packed micro-batches carry each sample's images and M-RoPE positions (the
packed forward equals each sample's own HF forward within 1e-5 in fp32), the vision tower is frozen by default, and
one GRPO step runs through the Trainer on the synthetic shapes task (true on-policy mode refuses vision by name)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("PIL")

from rlbench.backends.vision import pack_vision_inputs  # noqa: E402
from rlbench.configs.data import DataConfig  # noqa: E402
from rlbench.data.datasets import PromptDataset  # noqa: E402
from rlbench.data.shapes import write_shapes_task  # noqa: E402
from rlbench.data.tokenizer import build_tokenizer  # noqa: E402
from rlbench.models.vlm import auto_model_class, build_vlm_config, preset_processor  # noqa: E402
from rlbench.packing import pack_samples  # noqa: E402
from rlbench.types import Sample  # noqa: E402


def _model(attn: str):
    config = build_vlm_config("tiny-vl")
    torch.manual_seed(0)
    return auto_model_class(config).from_config(config, dtype=torch.float32, attn_implementation=attn).eval()


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """(train, eval) jsonl paths of the colour task (28 x 28 images)."""
    return write_shapes_task(str(tmp_path_factory.mktemp("shapes")), kind="count", n_train=16, n_eval=4, seed=0)


def _samples(shapes) -> list[Sample]:
    tokenizer = build_tokenizer(128, vision=True)
    items = PromptDataset(DataConfig(path=shapes[0], shuffle=False), tokenizer,
                          preset_processor("tiny-vl", tokenizer)).items
    text = tokenizer("<|im_start|>user\nno image<|im_end|>\n", add_special_tokens=False)["input_ids"]
    rows = [(items[0].prompt_token_ids, items[0].images), (text, None), (items[1].prompt_token_ids, items[1].images)]
    return [Sample(tokens=ids + [5, 6, 7, 8], response_length=4, images=im) for ids, im in rows]


def _alone(model, s: Sample) -> torch.Tensor:
    x = {"input_ids": torch.tensor([s.tokens]), "attention_mask": torch.ones(1, len(s.tokens), dtype=torch.long)}
    if s.images is not None:
        x |= {"pixel_values": s.images.pixel_values, "image_grid_thw": s.images.image_grid_thw,
              "mm_token_type_ids": (x["input_ids"] == model.config.image_token_id).int()}
    return model(**x, use_cache=False).logits[0]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_forward_equals_per_sequence(shapes, attn, one_thread):
    """The trainer's VLM pack (`pack_vision_inputs`: 4-row positions, the pack's images in order) against each
    sample's own HF forward (its own get_rope_index); without the text row transformers would not separate the
    samples (negative control)."""
    model = _model(attn)
    samples = _samples(shapes)
    pack = pack_samples(samples, pad_multiple=8)
    extra = pack_vision_inputs(model, pack, pack.tokens, pack.position_ids)
    assert extra["position_ids"].shape == (4, 1, pack.num_tokens) and extra["image_grid_thw"].shape == (2, 3)
    with torch.no_grad():
        packed = model(input_ids=pack.tokens[None], use_cache=False, **extra).logits[0]
        alone = [_alone(model, s) for s in samples]
        mixed = model(input_ids=pack.tokens[None], use_cache=False, position_ids=extra["position_ids"][1:],
                      pixel_values=extra["pixel_values"], image_grid_thw=extra["image_grid_thw"]).logits[0]
    starts = pack.cu_seqlens.tolist()
    diff = max((packed[s : s + len(a)] - a).abs().max().item() for s, a in zip(starts, alone))
    assert diff <= 1e-5, f"packed vs alone {diff:.2e}"
    leak = max((mixed[s : s + len(a)] - a).abs().max().item() for s, a in zip(starts, alone))
    assert leak > 1e-3


def _hf_dir(tmp_path) -> str:
    path = str(tmp_path / "tiny-vl")
    model = _model("sdpa")
    model.save_pretrained(path)
    tokenizer = build_tokenizer(128, vision=True)
    tokenizer.save_pretrained(path)
    preset_processor("tiny-vl", tokenizer).image_processor.save_pretrained(path)
    return path


def _run_config(path: str, data: str, workdir: str, on_policy: bool = False, **backend):
    from rlbench import presets
    from rlbench.configs import EvalConfig

    cfg = presets.cpu_test(model=path, workdir=workdir, level=1, n_eval=4)
    return cfg.replace(
        true_on_policy_mode=on_policy, eval=EvalConfig(), task=None,
        data=DataConfig(path=data, seed=0, metadata_key=None),
        rollout=dataclasses.replace(cfg.rollout, rm_type="chars", rollout_batch_size=2, n_samples_per_prompt=4,
                                    max_response_len=4),
        engine=dataclasses.replace(cfg.engine, max_seq_len=48),
        batch=dataclasses.replace(cfg.batch, global_batch_size=8, num_rollout=1),
        backend=dataclasses.replace(cfg.backend, **backend))


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()


def _char_reward(response: str, label) -> float:
    return (sum(map(ord, response)) % 7) / 6  # spread over a random model's responses: non-zero advantages


def test_grpo_step_with_images_through_the_trainer(shapes, tmp_path, monkeypatch, one_thread):
    """One GRPO step from a saved VLM directory (HF default weights layout: `model.layers`, `visual.`): the rollout
    and trainer log-probs agree within 1e-5, the language model moves and the frozen vision tower does not."""
    from rlbench import Trainer
    from rlbench.rewards import REWARDS

    monkeypatch.setitem(REWARDS, "chars", _char_reward)

    path = _hf_dir(tmp_path)
    trainer = Trainer(_run_config(path, shapes[0], str(tmp_path / "run")))
    model = trainer.backend.model
    before = {n: _full(p) for n, p in model.named_parameters()}
    assert not any(p.requires_grad for n, p in model.named_parameters() if n.startswith("model.visual."))
    m = trainer.step()
    assert m["train/grad_norm"] > 0
    assert m["train/train_rollout_logprob_abs_diff"] <= 1e-5
    moved = {n for n, p in model.named_parameters() if not torch.equal(_full(p), before[n])}
    assert moved and not any(n.startswith("model.visual.") for n in moved)
    assert any(n.startswith("model.language_model.layers.") for n in moved)


def test_true_on_policy_refuses_vision_and_freeze_modules_are_checked(shapes, tmp_path, monkeypatch, one_thread):
    from rlbench import Trainer
    from rlbench.rewards import REWARDS

    monkeypatch.setitem(REWARDS, "chars", _char_reward)

    path = _hf_dir(tmp_path)
    with pytest.raises(ValueError, match=r"qwen2_5_vl a vision tower \(VLM\): true on-policy mode does not implement"):
        Trainer(_run_config(path, shapes[0], str(tmp_path / "a"), on_policy=True))
    with pytest.raises(ValueError, match="freeze_modules prefix 'model.vision.' matches no parameter"):
        Trainer(_run_config(path, shapes[0], str(tmp_path / "b"), freeze_modules=("model.vision.",)))


def test_cuda_default_attention_falls_back_to_sdpa_for_a_vlm(capsys):
    """The CUDA default (flex_attention) has no Qwen2.5-VL path in transformers: a VLM trains with sdpa, said once;
    an explicit choice is kept, and a text model keeps flex."""
    from rlbench.backends.fsdp.model import with_model_attention
    from rlbench.configs.backend import FSDPOptions, TrainConfig

    vlm = with_model_attention(TrainConfig(model="tiny-vl", device="cuda"))
    assert vlm.attention == "sdpa" and "uses sdpa" in capsys.readouterr().out
    explicit = TrainConfig(model="tiny-vl", device="cuda", fsdp=FSDPOptions(attn_implementation="eager"))
    assert with_model_attention(explicit) is explicit
    text = TrainConfig(model="tiny", device="cuda")
    assert with_model_attention(text).attention == "flex_attention"
