"""rlbench.data: the char-level Qwen-style tokenizer and slime-layout PromptDataset."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from rlbench.data import DataConfig, PromptDataset, build_tokenizer, make_arithmetic, write_jsonl
from rlbench.data.tokenizer import alphabet


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


# ---- tokenizer -------------------------------------------------------------------------------------


def test_special_tokens_and_size(tok):
    assert len(tok) == 128
    assert tok.pad_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"
    assert tok.convert_ids_to_tokens([tok.pad_token_id, tok.eos_token_id]) == ["<|endoftext|>", "<|im_end|>"]
    assert tok.bos_token is None


def test_every_task_character_is_one_token_and_round_trips(tok):
    text = "".join(alphabet())  # digits, letters, punctuation incl. \\ { } + - * / =, space, \n, \t
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tok.unk_token_id not in ids
    assert tok.decode(ids) == text


def test_chat_template_matches_qwen_text_after_save_and_autotokenizer(tmp_path, tok):
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is \\boxed{12+3}?"}]
    text = loaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is \\boxed{12+3}?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = loaded(text, add_special_tokens=False)["input_ids"]
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == loaded.convert_tokens_to_ids("<|im_start|>") and ids.count(loaded.eos_token_id) == 2
    assert loaded.decode(ids) == text
    no_gen = loaded.apply_chat_template(messages[1:], tokenize=False, add_generation_prompt=False)
    assert no_gen.endswith("<|im_end|>\n") and "assistant" not in no_gen


def test_every_model_id_decodes_and_unknown_chars_map_to_unk(tok):
    assert all(isinstance(tok.decode([i]), str) for i in range(128))
    assert tok("é", add_special_tokens=False)["input_ids"] == [tok.unk_token_id]


def test_too_small_vocab_raises():
    with pytest.raises(ValueError, match="too small"):
        build_tokenizer(vocab_size=50)


# ---- PromptDataset -----------------------------------------------------------------------------------


def _write(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


@pytest.fixture
def arith_path(tmp_path):
    path = tmp_path / "arith.jsonl"
    write_jsonl(make_arithmetic(23, seed=1), path)
    return str(path)


def test_items_are_chat_templated_with_labels_and_metadata(arith_path, tok):
    ds = PromptDataset(DataConfig(path=arith_path, shuffle=False), tok)
    rows = make_arithmetic(23, seed=1)
    assert len(ds) == 23 and ds.num_dropped == 0
    item = ds.next_batch(1)[0]
    assert item.prompt == f"<|im_start|>user\n{rows[0]['prompt']}<|im_end|>\n<|im_start|>assistant\n"
    assert item.label == rows[0]["label"] and item.metadata == rows[0]["metadata"] and item.index == 0
    assert item.prompt_token_ids == tok(item.prompt, add_special_tokens=False)["input_ids"]


def test_message_list_prompt_and_raw_string_prompt(tmp_path, tok):
    path = _write(tmp_path / "m.jsonl", [{"input": [{"role": "user", "content": "hi"}], "ans": 1}])
    ds = PromptDataset(DataConfig(path=path, input_key="input", label_key="ans", shuffle=False), tok)
    assert ds[0].prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n" and ds[0].label == 1
    path = _write(tmp_path / "r.jsonl", [{"prompt": "raw text"}])
    ds = PromptDataset(DataConfig(path=path, label_key=None, apply_chat_template=False), None)
    assert ds[0].prompt == "raw text" and ds[0].label is None and ds[0].prompt_token_ids is None


def test_max_prompt_length_drops_and_counts(tmp_path, tok):
    rows = [{"prompt": "x" * n, "label": str(n)} for n in (1, 5, 10, 20)]
    path = _write(tmp_path / "p.jsonl", rows)
    overhead = len(tok(tok.apply_chat_template([{"role": "user", "content": ""}], tokenize=False,
                                              add_generation_prompt=True))["input_ids"])
    with pytest.warns(UserWarning, match="dropped 2 of 4"):
        ds = PromptDataset(DataConfig(path=path, max_prompt_length=overhead + 5, shuffle=False), tok)
    assert ds.num_dropped == 2 and [it.label for it in ds.items] == ["1", "5"]
    assert [it.index for it in ds.items] == [0, 1]


def test_epochs_are_permutations_reshuffled_by_seed_plus_epoch(arith_path, tok):
    ds = PromptDataset(DataConfig(path=arith_path, seed=5), tok)
    e0 = [it.index for it in ds.next_batch(23)]
    e1 = [it.index for it in ds.next_batch(23)]
    assert sorted(e0) == sorted(e1) == list(range(23)) and e0 != e1
    again = PromptDataset(DataConfig(path=arith_path, seed=5), tok)
    assert [it.index for it in again.next_batch(46)] == e0 + e1  # a batch crossing the epoch boundary
    other = PromptDataset(DataConfig(path=arith_path, seed=6), tok)
    assert [it.index for it in other.next_batch(23)] != e0


def test_resume_from_state_dict_gives_the_same_next_batches(arith_path, tok):
    ds = PromptDataset(DataConfig(path=arith_path), tok)
    ds.next_batch(10)
    ds.next_batch(10)
    ds.next_batch(10)  # now in epoch 1, position 7
    state = json.loads(json.dumps(ds.state_dict()))  # must survive a JSON checkpoint
    assert (state["epoch"], state["position"]) == (1, 7)
    expected = [[it.index for it in ds.next_batch(9)] for _ in range(4)]
    fresh = PromptDataset(DataConfig(path=arith_path), tok)
    fresh.load_state_dict(state)
    assert [[it.index for it in fresh.next_batch(9)] for _ in range(4)] == expected
    with pytest.raises(ValueError, match="same file, filter and seed"):
        PromptDataset(DataConfig(path=arith_path, seed=1), tok).load_state_dict(state)


def test_malformed_line_names_file_and_line(tmp_path, tok):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "label": "1"}\n{"prompt": "b", "label": \n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: invalid JSON"):
        PromptDataset(DataConfig(path=str(path)), tok)
    path.write_text('{"prompt": "a", "label": "1"}\n\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: empty line"):
        PromptDataset(DataConfig(path=str(path)), tok)
    path.write_text('[1, 2]\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: expected a JSON object, got list"):
        PromptDataset(DataConfig(path=str(path)), tok)


def test_missing_key_names_key_and_available_keys(tmp_path, tok):
    path = _write(tmp_path / "k.jsonl", [{"prompt": "a", "label": "1"}, {"question": "b", "answer": "2"}])
    with pytest.raises(ValueError, match=r"k\.jsonl:2: missing key 'prompt'; available keys: \['answer', 'question'\]"):
        PromptDataset(DataConfig(path=path), tok)


def test_parquet_matches_jsonl(tmp_path, arith_path, tok):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = make_arithmetic(23, seed=1)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "arith.parquet")
    a = PromptDataset(DataConfig(path=str(tmp_path / "arith.parquet")), tok).next_batch(30)
    b = PromptDataset(DataConfig(path=arith_path), tok).next_batch(30)
    assert [(x.prompt, x.label, x.metadata) for x in a] == [(x.prompt, x.label, x.metadata) for x in b]


def test_config_validation_and_tokenizer_requirement(arith_path):
    with pytest.raises(ValueError, match="must end in .jsonl or .parquet"):
        DataConfig(path="data.csv")
    with pytest.raises(ValueError, match="max_prompt_length=0"):
        DataConfig(path="a.jsonl", max_prompt_length=0)
    with pytest.raises(ValueError, match="need a tokenizer"):
        PromptDataset(DataConfig(path=arith_path), None)


def test_a_preset_model_gets_a_tokenizer_of_its_vocabulary():
    """A preset name (random init) gets the char-level tokenizer padded to the preset's vocabulary, so every id the
    model samples decodes; an HF directory brings its own."""
    from rlbench.orchestration.local import build_tokenizer_for

    assert len(build_tokenizer_for("tiny")) == 128
    tok = build_tokenizer_for("tiny", {"vocab_size": 300})
    assert len(tok) == 300 and tok.decode([299]).startswith("<|reserved_")  # was: the 128-token tokenizer
