"""Prompt rows with images (rlbench.data.images): paths and base64 through the VLM's processor, placeholder tokens
expanded to the patch count, and one-line errors for a missing or corrupt image and for images on a text-only model."""

from __future__ import annotations

import base64
import io
import json

import pytest
import torch

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from rlbench.configs.data import DataConfig  # noqa: E402
from rlbench.data.datasets import PromptDataset  # noqa: E402
from rlbench.data.images import IMAGE_TOKEN, VisionProcessor, tiny_image_processor  # noqa: E402
from rlbench.data.tokenizer import build_tokenizer  # noqa: E402


def _png(color, side: int = 28) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (side, side), color).save(buf, format="PNG")
    return buf.getvalue()


def _write(tmp_path, rows) -> str:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def processor():
    return VisionProcessor(tiny_image_processor(), build_tokenizer(128, vision=True))


def test_paths_and_base64_expand_to_the_patch_count(tmp_path, processor):
    (tmp_path / "red.png").write_bytes(_png((255, 0, 0)))
    inline = "data:image/png;base64," + base64.b64encode(_png((255, 0, 0), 56)).decode()
    path = _write(tmp_path, [{"prompt": "colour?", "label": "red", "images": ["red.png"]},
                             {"prompt": "colours?", "label": "x", "images": ["red.png", inline]},
                             {"prompt": "no image", "label": "y"}])
    ds = PromptDataset(DataConfig(path=path), processor.tokenizer, processor)
    image_id = processor.image_token_id
    one, two, text = ds.items
    # 28 x 28 at patch 7: a 4 x 4 grid, 2 x 2 merged -> 4 tokens; 56 x 56: 8 x 8 -> 16 tokens
    assert one.prompt_token_ids.count(image_id) == 4 and one.images.image_grid_thw.tolist() == [[1, 4, 4]]
    assert two.prompt_token_ids.count(image_id) == 20
    assert two.images.image_grid_thw.tolist() == [[1, 4, 4], [1, 8, 8]]
    assert two.images.pixel_values.shape == (16 + 64, 3 * 2 * 7 * 7)
    assert two.images.sources == ["red.png", "base64"]
    assert one.prompt.count(IMAGE_TOKEN) == 1 and "colour?" in one.prompt
    assert text.images is None and image_id not in text.prompt_token_ids
    # the same pixels from a file and from base64
    again = PromptDataset(DataConfig(path=_write(tmp_path, [{"prompt": "c", "label": "r", "images": [
        base64.b64encode(_png((255, 0, 0))).decode()]}])), processor.tokenizer, processor)
    assert torch.equal(again.items[0].images.pixel_values, one.images.pixel_values)


@pytest.mark.parametrize("images, message", [
    (["absent.png"], r"data.jsonl:1: image 0: image file '.*absent.png' does not exist; fix the path"),
    (["bad.png"], r"data.jsonl:1: image 0: .*bad.png is not a readable image"),
    (["data:image/png;base64,@@@"], r"data.jsonl:1: image 0: base64 image is not valid base64"),
    ("red.png", r"data.jsonl:1: 'images' must be a list of image paths or base64 strings, got str"),
])
def test_bad_images_are_named(tmp_path, processor, images, message):
    (tmp_path / "bad.png").write_bytes(b"not a png")
    (tmp_path / "red.png").write_bytes(_png((255, 0, 0)))
    path = _write(tmp_path, [{"prompt": "colour?", "label": "red", "images": images}])
    with pytest.raises(ValueError, match=message) as err:
        PromptDataset(DataConfig(path=path), processor.tokenizer, processor)
    assert "\n" not in str(err.value)


def test_images_for_a_text_only_model_are_refused(tmp_path):
    (tmp_path / "red.png").write_bytes(_png((255, 0, 0)))
    path = _write(tmp_path, [{"prompt": "colour?", "label": "red", "images": ["red.png"]}])
    with pytest.raises(ValueError, match=r"data.jsonl:1: the row has 1 images \('images'\) but the model is text-only"):
        PromptDataset(DataConfig(path=path), build_tokenizer())
    ds = PromptDataset(DataConfig(path=path, image_key=None), build_tokenizer())  # images ignored on request
    assert ds.items[0].images is None


def test_message_prompts_need_one_image_part_per_image(tmp_path, processor):
    (tmp_path / "red.png").write_bytes(_png((255, 0, 0)))
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is"}, {"type": "image"}]}]
    ok = PromptDataset(DataConfig(path=_write(tmp_path, [{"prompt": messages, "label": "r", "images": ["red.png"]}])),
                       processor.tokenizer, processor)
    assert ok.items[0].prompt.index("what is") < ok.items[0].prompt.index(IMAGE_TOKEN)
    path = _write(tmp_path, [{"prompt": messages, "label": "r", "images": ["red.png", "red.png"]}])
    with pytest.raises(ValueError, match="the messages hold 1 image parts"):
        PromptDataset(DataConfig(path=path), processor.tokenizer, processor)


def test_longest_prompt_counts_the_expanded_image_tokens(tmp_path, monkeypatch, capsys):
    """`rlbench train DIR --prompt-data FILE` without a preset sizes the engine from the longest prompt as the engine
    holds it: a 56 x 56 image is 16 `<|image_pad|>` tokens, not the one placeholder of the template's text."""
    from rlbench.cli import main
    from rlbench.models.vlm import auto_model_class, build_vlm_config, preset_processor
    from rlbench.presets import longest_prompt

    tokenizer = build_tokenizer(128, vision=True)
    config = build_vlm_config("tiny-vl")
    auto_model_class(config).from_config(config).save_pretrained(tmp_path / "vl")
    tokenizer.save_pretrained(tmp_path / "vl")
    preset_processor("tiny-vl", tokenizer).image_processor.save_pretrained(tmp_path / "vl")
    (tmp_path / "big.png").write_bytes(_png((0, 0, 255), 56))
    (tmp_path / "small.png").write_bytes(_png((255, 0, 0), 28))
    path = _write(tmp_path, [{"prompt": "colour?", "label": "blue", "images": ["big.png"]},
                             {"prompt": "what colour is it?", "label": "red", "images": ["small.png"]}])
    text = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                       {"type": "text", "text": "colour?"}]}],
                                         tokenize=False, add_generation_prompt=True)
    assert text.count(IMAGE_TOKEN) == 1
    with_one_placeholder = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    longest = longest_prompt(str(tmp_path / "vl"), DataConfig(path=path), path)
    assert longest == with_one_placeholder + 15 == 44  # 16 image tokens; the other row: 4 + 11 more chars = 43
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--hf-checkpoint", "vl", "--prompt-data", "data.jsonl", "--device", "cpu",
                 "--rollout-max-response-len", "8", "--print-config"]) == 0
    assert json.loads(capsys.readouterr().out)["engine"]["max_seq_len"] == 16 * -(-(44 + 8) // 16) == 64
