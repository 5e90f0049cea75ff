"""The torch engine on a tiny random Qwen2.5-VL: prompts with images prefilled through the model's own vision tower
and M-RoPE positions, decode continuing at the images' offset; greedy tokens equal HF `generate` token for token and
log-probs HF's forward within 1e-5 (fp32)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("PIL")
from PIL import Image, ImageDraw  # noqa: E402

from rlbench.data.images import VisionProcessor, image_messages, tiny_image_processor  # noqa: E402
from rlbench.data.tokenizer import build_tokenizer  # noqa: E402
from rlbench.engine import SamplingParams, TorchEngine, TorchEngineConfig  # noqa: E402
from rlbench.models.vlm import auto_model_class, build_vlm_config  # noqa: E402

NEW = 10


def _model():
    """tiny-vl at hidden 32, its 2-D weights x4 (decisive logits: greedy has no near-ties)."""
    config = build_vlm_config("tiny-vl", hidden_size=32, intermediate_size=64,
                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]})
    config.vision_config.out_hidden_size = 32
    torch.manual_seed(0)
    model = auto_model_class(config).from_config(config, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4)
    return model.eval()


def _image(color, box, side=28):
    img = Image.new("RGB", (side, side), "white")
    ImageDraw.Draw(img).rectangle(box, fill=color)
    return img


def _prompts(tmp_path):
    """(ids, ImageInputs | None) for: one image, two images of different sizes, text only."""
    proc = VisionProcessor(tiny_image_processor(), build_tokenizer(128, vision=True))
    files = []
    for i, (color, box, side) in enumerate([("red", (3, 3, 20, 20), 28), ("blue", (10, 2, 26, 12), 28),
                                            ("green", (5, 30, 50, 50), 56)]):
        path = tmp_path / f"{i}.png"
        _image(color, box, side).save(path)
        files.append(str(path))
    out = []
    for text, specs in [("colour?", files[:1]), ("which two?", files[1:]), ("no image here", [])]:
        if specs:
            _, ids, images = proc.encode(image_messages(text, len(specs), "t"), specs, str(tmp_path), "t")
        else:
            rendered = proc.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                          add_generation_prompt=True)
            ids, images = proc.tokenizer(rendered, add_special_tokens=False)["input_ids"], None
        out.append((ids, images))
    return out


def _hf_inputs(model, ids, images) -> dict:
    x = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
    if images is not None:
        x |= {"pixel_values": images.pixel_values, "image_grid_thw": images.image_grid_thw,
              "mm_token_type_ids": (x["input_ids"] == model.config.image_token_id).int()}
    return x


def _hf_logprobs(model, ids, images, tokens) -> torch.Tensor:
    with torch.no_grad():
        logits = model(**_hf_inputs(model, ids + tokens, images)).logits[0]
    return torch.log_softmax(logits.float(), -1)[len(ids) - 1 : -1].gather(-1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.mark.parametrize("shared_prefix", [False, True], ids=["slots", "grouped"])
def test_engine_greedy_equals_hf_generate_with_images(tmp_path, shared_prefix, one_thread):
    model = _model()
    prompts = _prompts(tmp_path)
    engine = TorchEngine(copy.deepcopy(model), TorchEngineConfig(max_seq_len=96, num_slots=6,
                                                                 shared_prefix=shared_prefix))
    gens = engine.generate([p for p, _ in prompts], SamplingParams(temperature=0.0, max_new_tokens=NEW, n=2),
                           images=[im for _, im in prompts])
    for i, (ids, images) in enumerate(prompts):
        ref = model.generate(**_hf_inputs(model, ids, images), max_new_tokens=NEW, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        for g in gens[2 * i : 2 * i + 2]:
            assert g.token_ids == ref, f"prompt {i}: engine {g.token_ids} != HF {ref}"
            diff = (_hf_logprobs(model, ids, images, g.token_ids) - torch.tensor(g.log_probs)).abs().max().item()
            assert diff <= 1e-5, f"prompt {i}: max |log-prob diff| {diff:.2e}"


def test_the_images_and_the_offset_move_the_logprobs(tmp_path, monkeypatch, one_thread):
    """Negative controls: without the image embeddings and 3-D positions, or without the M-RoPE offset at decode
    (-2 here: a 2 x 2 token image takes 2 positions), the engine is off HF's log-probs, so the 1e-5 comparison above
    can fail."""
    model = _model()
    ids, images = _prompts(tmp_path)[0]
    engine = TorchEngine(copy.deepcopy(model), TorchEngineConfig(max_seq_len=96, num_slots=2))
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW)
    blind = engine.generate([ids], params)[0]  # the placeholders' own embeddings, text positions
    assert (_hf_logprobs(model, ids, images, blind.token_ids) - torch.tensor(blind.log_probs)).abs().max() > 1e-3
    prefill = engine.runner.prefill

    def no_offset(*args, **kwargs):
        logits = prefill(*args, **kwargs)
        assert engine.runner.prefill_deltas == [-2]
        engine.runner.prefill_deltas = [0]
        return logits

    monkeypatch.setattr(engine.runner, "prefill", no_offset)
    g = engine.generate([ids], params, images=[images])[0]
    assert (_hf_logprobs(model, ids, images, g.token_ids) - torch.tensor(g.log_probs)).abs().max() > 1e-3


def test_images_for_a_text_only_model_or_a_session_are_refused(tmp_path, one_thread):
    from rlbench.models import build_model

    prompts = _prompts(tmp_path)
    text_engine = TorchEngine(build_model("tiny"), TorchEngineConfig(max_seq_len=96, num_slots=2))
    with pytest.raises(ValueError, match="images given to Qwen3ForCausalLM, a text-only model"):
        text_engine.generate([prompts[0][0]], SamplingParams(max_new_tokens=2), images=[prompts[0][1]])
    engine = TorchEngine(_model(), TorchEngineConfig(max_seq_len=96, num_slots=2))
    with pytest.raises(ValueError, match="sessions \\(keep=True\\) with images are not supported yet"):
        engine.generate([prompts[0][0]], SamplingParams(max_new_tokens=2), images=[prompts[0][1]], keep=True)
