"""rlbench.sft: batch construction, response-only loss (float64 reference), splits, and a tiny run that learns."""

from __future__ import annotations

import json
import os

import pytest
import torch

from rlbench.data.tokenizer import build_tokenizer
from rlbench.models import build_model, load_model, load_tokenizer
from rlbench.sft import SFTConfig, collate, encode_sft, evaluate_pass_at_1, main, sft_loss, split_rows


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_encode_and_collate_mask_everything_but_the_response(tok):
    rows = [{"prompt": "1+2=?", "metadata": {"solution": "\\boxed{3}"}},
            {"prompt": "12+30=?", "metadata": {"solution": "\\boxed{42}"}}]
    examples = encode_sft(rows, tok)
    batch = collate(examples, tok.pad_token_id)
    assert batch["input_ids"].shape == (2, max(len(ids) for ids, _ in examples))
    for b, (ids, n_prompt) in enumerate(examples):
        text = tok.decode(ids[:n_prompt])
        assert text == "<|im_start|>user\n" + rows[b]["prompt"] + "<|im_end|>\n<|im_start|>assistant\n"
        trained = batch["labels"][b][batch["labels"][b] != -100].tolist()
        assert tok.decode(trained) == rows[b]["metadata"]["solution"] + "<|im_end|>"
        assert trained[-1] == tok.eos_token_id
        assert batch["attention_mask"][b].sum() == len(ids)
        assert (batch["input_ids"][b, len(ids):] == tok.pad_token_id).all()


def test_sft_loss_matches_float64_reference(tok):
    torch.manual_seed(0)
    model = build_model("tiny", seed=1)
    rows = [{"prompt": "7*8=?", "metadata": {"solution": "\\boxed{56}"}},
            {"prompt": "3-9=?", "metadata": {"solution": "\\boxed{-6}"}}]
    batch = collate(encode_sft(rows, tok), tok.pad_token_id)
    loss = sft_loss(model, batch)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.double()
    logp = torch.log_softmax(logits, dim=-1)
    terms = [
        -logp[b, t - 1, batch["labels"][b, t]]
        for b in range(2) for t in range(1, batch["labels"].shape[1]) if batch["labels"][b, t] != -100
    ]
    ref = torch.stack(terms).mean()  # mean over response tokens only
    assert len(terms) == 11 + 11  # "\boxed{56}"+eos, "\boxed{-6}"+eos
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)


def test_disjoint_split_has_no_shared_prompt():
    cfg = SFTConfig(task_kwargs={"level": 3}, num_train=2000, num_eval=50, disjoint_eval=True)
    train, heldout = split_rows(cfg)
    assert len(heldout) == 50 and 1900 <= len(train) < 2000
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in heldout}
    with pytest.raises(ValueError, match="too few distinct problems.*disjoint_eval=False"):
        split_rows(SFTConfig(task_kwargs={"level": 1}, num_train=1000, num_eval=200, disjoint_eval=True))


def test_config_validation():
    with pytest.raises(ValueError, match="task='sudoku'"):
        SFTConfig(task="sudoku")
    with pytest.raises(ValueError, match="batch_size=0"):
        SFTConfig(batch_size=0)
    with pytest.raises(ValueError, match="target_pass_at_1=1.5"):
        SFTConfig(target_pass_at_1=1.5)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cuda' but CUDA is not available"):
            SFTConfig(device="cuda")


def test_preset_vocab_is_kept_when_asked(tmp_path, monkeypatch):
    """`tokenizer_vocab=False` (the GPU warm start, `presets.gpu_sft`) keeps the preset's larger vocabulary."""
    from rlbench.models import presets as model_presets
    from rlbench.sft import run_sft

    monkeypatch.setitem(model_presets.PRESETS, "tiny-wide", dict(model_presets.PRESETS["tiny"], vocab_size=300))
    base = dict(preset="tiny-wide", task_kwargs={"level": 1}, max_steps=2, eval_every=2, num_eval=4, batch_size=8,
                num_train=64, target_pass_at_1=None)
    out = str(tmp_path / "wide")
    run_sft(SFTConfig(**base, tokenizer_vocab=False, out=out))
    assert load_model(out).config.vocab_size == 300
    run_sft(SFTConfig(**base, out=out))
    assert load_model(out).config.vocab_size == 128


def test_tiny_sft_learns_and_saves_a_loadable_model(tmp_path, tok):
    # The quick config: tiny preset, level-1 arithmetic (1-digit +), stop at sampled pass@1 >= 0.1.
    out = str(tmp_path / "sft")
    metrics = main(["--preset", "tiny", "--level", "1", "--out", out, "--max-steps", "300", "--eval-every", "20",
                    "--batch-size", "32", "--lr", "3e-3", "--num-eval", "64", "--target-pass-at-1", "0.1",
                    "--num-threads", "1"])
    assert metrics["eval/pass@1"] >= 0.1 and metrics["sft/stopped_early"]
    assert metrics["history"][0]["sft/loss"] > metrics["sft/loss"]
    saved = json.load(open(os.path.join(out, "sft_metrics.json")))
    assert saved["eval/pass@1"] == metrics["eval/pass@1"] and saved["config"]["preset"] == "tiny"
    model, tok2 = load_model(out), load_tokenizer(out)
    assert model.config.eos_token_id == tok2.eos_token_id == tok.eos_token_id
    # Greedy pass@1 is deterministic: the reloaded model scores exactly what the run reported.
    _, eval_rows = split_rows(SFTConfig(preset="tiny", task_kwargs={"level": 1}, num_eval=64))
    greedy = evaluate_pass_at_1(model, tok2, eval_rows, greedy=True, max_new_tokens=24, seed=0)
    assert greedy == metrics["eval/pass@1_greedy"]
