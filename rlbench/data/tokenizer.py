"""A character-level tokenizer with Qwen's special tokens and chat template, for the tiny CPU models.

Every printable ASCII character plus newline and tab is one token; `<|endoftext|>` (pad),
`<|im_start|>` and `<|im_end|>` (eos) are special tokens exactly as in Qwen checkpoints, and the
vocabulary is padded with `<|reserved_k|>` tokens up to `vocab_size` (128, the `tiny`/`small`
preset vocabulary) so that every id a model can sample decodes. The result is a standard
`PreTrainedTokenizerFast`: `save_pretrained(dir)` then `AutoTokenizer.from_pretrained(dir)` and
`apply_chat_template(messages, tokenize=False, add_generation_prompt=True)` behave as for Qwen.
"""

from __future__ import annotations

import string

from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)
UNK_TOKEN = "<|unk|>"
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
"""Qwen2-VL/2.5-VL's image tokens (`build_tokenizer(vision=True)`): the processor expands each `<|image_pad|>` into
one token per merged image patch."""

# The same text the Qwen2.5/Qwen3 templates produce for plain user/assistant/system turns
# (no default system prompt, no tools, no thinking block); a content list (Qwen2.5-VL's layout) renders its images
# as `<|vision_start|><|image_pad|><|vision_end|>`, as Qwen2.5-VL's template does.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def alphabet() -> list[str]:
    """The characters that get their own token: printable ASCII (digits, letters, punctuation, space), \\n, \\t."""
    chars = [c for c in string.printable if c not in "\r\x0b\x0c"]
    return sorted(set(chars), key=chars.index)


def build_tokenizer(vocab_size: int = 128, vision: bool = False) -> PreTrainedTokenizerFast:
    """The char-level Qwen-style tokenizer.

    Args:
        vocab_size: total size including special and reserved tokens; must match the model's
            `vocab_size` (128 for the `tiny`/`small` presets). `len(tokenizer) == vocab_size`.
        vision: also Qwen2.5-VL's image tokens (`VISION_TOKENS`, special), for a VLM's processor.

    Returns:
        a fast tokenizer with pad `<|endoftext|>`, eos `<|im_end|>` and a Qwen chat template.
    """
    chars = alphabet()
    special = list(SPECIAL_TOKENS) + (list(VISION_TOKENS) if vision else [])
    base = len(chars) + 1 + len(special)  # + unk
    if vocab_size < base:
        raise ValueError(f"vocab_size={vocab_size} is too small for the {base} base tokens; pass >= {base}")
    vocab = {c: i for i, c in enumerate(chars)}
    vocab[UNK_TOKEN] = len(vocab)
    # BPE with no merges is exactly character-level; Fuse joins the pieces back without spaces.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN))
    core.decoder = decoders.Fuse()
    reserved = [f"<|reserved_{k}|>" for k in range(vocab_size - base)]
    core.add_special_tokens(special + reserved)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token=UNK_TOKEN,
        pad_token=PAD_TOKEN,
        eos_token=IM_END,
        bos_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    assert len(tok) == vocab_size, (len(tok), vocab_size)
    return tok
