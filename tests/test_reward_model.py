"""Reward models: preference rows checked (file:line), Bradley-Terry training on the synthetic preferences reaches
>= 90 % held-out pair accuracy, the step's gradient does not depend on packing, serving scores equal a plain
per-sequence forward, `rlbench rm` on the command line."""

from __future__ import annotations

import json
import time

import pytest
import torch

from rlbench.cli import main as cli_main
from rlbench.configs.reward_model import RMTrainConfig
from rlbench.data.preferences import (
    ANSWER_PAIRS,
    hidden_rule_score,
    is_short_form,
    make_arithmetic_preferences,
    with_long_forms,
)
from rlbench.data.tasks import arithmetic_level, make_arithmetic, verify_arithmetic, write_jsonl
from rlbench.models.value_head import load_value_model, read_stamp, token_values
from rlbench.reward_model.data import encode_pair, load_preferences, render_prompt
from rlbench.reward_model.serve import RewardModel
from rlbench.reward_model.train import build_rm, encode_pairs, run_rm, split_pairs, train_step


@pytest.fixture(scope="module")
def prefs(tmp_path_factory):
    path = tmp_path_factory.mktemp("prefs") / "prefs.jsonl"
    write_jsonl(make_arithmetic_preferences(800, level=1, seed=0), path)
    return str(path)


@pytest.fixture(scope="module")
def held_out(tmp_path_factory):
    """Another draw of the same rule, large enough that the accuracy's sampling error is ~1 %."""
    path = tmp_path_factory.mktemp("prefs") / "held_out.jsonl"
    write_jsonl(make_arithmetic_preferences(400, level=1, seed=1), path)
    return str(path)


def _cfg(prefs: str, **kw) -> RMTrainConfig:
    return RMTrainConfig(**({"data": prefs, "model": "tiny", "epochs": 1, "lr": 1e-3, "batch_size": 32,
                             "num_threads": 1} | kw))


def test_the_hidden_rule():
    assert [hidden_rule_score(r, 7) for r in ("\\boxed{7}", "\\boxed{8}", "so \\boxed{7}", "\\boxed{7} ok",
                                              "\\boxd{7}", " \\boxed{7}\n")] == [1.5, 1.0, 0.5, 0.5, 0.0, 1.5]
    rows = make_arithmetic_preferences(400, level=1, seed=3)
    assert rows == make_arithmetic_preferences(400, level=1, seed=3)  # seeded
    for row in rows:  # every pair is labelled by the rule
        meta = row["metadata"]
        assert hidden_rule_score(row["chosen"], meta["label"]) == meta["chosen_score"] > meta["rejected_score"] \
            == hidden_rule_score(row["rejected"], meta["label"])
    both_short = sum(is_short_form(r["chosen"]) and is_short_form(r["rejected"]) for r in rows) / len(rows)
    assert abs(both_short - ANSWER_PAIRS) < 0.05  # the answer-only share (binomial std 0.015)


def test_answer_pair_share_and_long_form_solutions():
    assert make_arithmetic_preferences(200, level=1, seed=3) == make_arithmetic_preferences(
        200, level=1, seed=3, answer_pairs=ANSWER_PAIRS)  # the default draw is unchanged
    for share, expected in ((1.0, 300), (0.0, 0)):
        rows = make_arithmetic_preferences(300, level=1, seed=4, answer_pairs=share)
        assert sum(is_short_form(r["chosen"]) and is_short_form(r["rejected"]) for r in rows) == expected
    rows = make_arithmetic(400, arithmetic_level(1), seed=0)
    long = with_long_forms(rows, 0.5, seed=0)
    assert all(is_short_form(r["metadata"]["solution"]) for r in rows)  # the input is left as it was
    n_long = sum(not is_short_form(r["metadata"]["solution"]) for r in long)
    assert 160 <= n_long <= 240, n_long  # binomial(400, 0.5): std 10
    for short, written in zip(rows, long):  # same prompt and answer; a long one scores 0.5 under the rule
        assert (written["prompt"], written["label"]) == (short["prompt"], short["label"])
        assert verify_arithmetic(written["metadata"]["solution"], written["label"])
        assert hidden_rule_score(written["metadata"]["solution"], written["label"]) in (0.5, 1.5)
    from rlbench.sft import SFTConfig, split_rows

    train, _ = split_rows(SFTConfig(task_kwargs={"level": 1}, num_train=200, long_form_share=1.0))
    assert not any(is_short_form(r["metadata"]["solution"]) for r in train)
    with pytest.raises(ValueError, match=r"share=1.5 must be in \[0, 1\]"):
        with_long_forms(rows, 1.5)
    with pytest.raises(ValueError, match="answer_pairs=-0.1 must be in"):
        make_arithmetic_preferences(10, answer_pairs=-0.1)
    with pytest.raises(ValueError, match="is for task='arithmetic'"):
        SFTConfig(task="countdown", task_kwargs={}, long_form_share=0.5)


def test_malformed_rows_are_named_by_file_and_line(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([
        json.dumps({"prompt": "1+1=?", "chosen": "\\boxed{2}", "rejected": "\\boxed{3}"}),
        "{not json",
        json.dumps({"prompt": "1+1=?", "chosen": "\\boxed{2}"}),
        json.dumps({"prompt": "1+1=?", "chosen": 2, "rejected": "\\boxed{3}"}),
        json.dumps({"prompt": "1+1=?", "chosen": "a", "rejected": "a"}),
        json.dumps({"prompt": "1+1=?", "chosen": "a", "rejected": "b", "margin": "big"}),
        json.dumps(["prompt", "chosen"]),
        json.dumps({"prompt": "", "chosen": "a", "rejected": "b"}),
    ]) + "\n")
    with pytest.raises(ValueError) as err:
        load_preferences(path)
    lines = str(err.value).splitlines()[1:]
    assert [line.split(": ", 1)[0] for line in lines] == [f"{path}:{n}" for n in range(2, 9)]
    for needle in ("not valid JSON", "missing ['rejected']", "'chosen' must be a string", "'chosen' equals "
                   "'rejected'", "'margin' must be a finite number", "must be a JSON object", "'prompt' must be"):
        assert needle in str(err.value)
    assert cli_main(["rm", "--data", str(path), "--num-threads", "1"]) == 2
    assert f"{path}:2: not valid JSON" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no such file"):
        load_preferences(tmp_path / "missing.jsonl")


def test_bradley_terry_training_reaches_90_percent_held_out(prefs, held_out, tmp_path):
    """A form-only scorer gets the ~90 % of pairs that differ in form and half of the answer-only ~10 %: ~95 %
    (measured 0.946 on 1000 fresh pairs; the answer-only pairs at 0.60)."""
    start = time.perf_counter()
    out = run_rm(_cfg(prefs, out=str(tmp_path / "rm"), eval_data=held_out))
    elapsed = time.perf_counter() - start
    before, after = out["history"][0], out["history"][-1]
    assert out["rm/train_pairs"] == 800 and out["rm/eval_pairs"] == 400
    assert before["rm/eval_accuracy"] == 0.0  # a zero head scores every sequence 0: no pair is ordered
    assert after["rm/eval_accuracy"] >= 0.9, out["history"]
    assert after["rm/eval_loss"] < before["rm/eval_loss"] - 0.2 and after["rm/eval_margin"] > 0.5
    stamp = read_stamp(tmp_path / "rm")
    assert stamp["kind"] == "reward" and stamp["version"] == out["version"] and stamp["eval_accuracy"] == \
        after["rm/eval_accuracy"]
    assert json.loads((tmp_path / "rm" / "rm_metrics.json").read_text())["rm/eval_pairs"] == 400
    print(f"rm training: {elapsed:.1f}s")


def test_the_step_gradient_does_not_depend_on_packing(prefs):
    """Micro-batches of one pair each vs one pack of the whole batch: the same loss and gradients."""
    grads, stats = [], []
    for max_tokens in (4096, 80):
        cfg = _cfg(prefs, max_tokens=max_tokens)
        torch.manual_seed(0)
        model, tok = build_rm(cfg)
        with torch.no_grad():
            model.score.weight.normal_(0, 0.1)  # a zero head sends no gradient into the backbone
        pairs, _ = split_pairs(cfg)
        seqs = encode_pairs(pairs, tok, True)
        assert max(len(seqs[2 * i]) + len(seqs[2 * i + 1]) for i in range(8)) <= 80 < sum(map(len, seqs[:16]))
        opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the step leaves the weights, keeps the grads
        stats.append(train_step(model, opt, pairs, seqs, list(range(8)), cfg, tok.pad_token_id))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)
    assert stats[0]["loss"] == pytest.approx(stats[1]["loss"], rel=1e-5) and stats[0]["accuracy"] == stats[1]["accuracy"]


def test_served_scores_equal_a_forward_of_each_sequence(prefs, tmp_path):
    run_rm(_cfg(prefs, out=str(tmp_path / "rm"), epochs=1, batch_size=64))
    rm = RewardModel(tmp_path / "rm")
    model = load_value_model(tmp_path / "rm", require_head=True).eval()
    prompts = [render_prompt(rm.tokenizer, p) for p in ("1+2=?", "3+4=?", "9+9=?")]
    responses = ["\\boxed{3}", "so \\boxed{7}", "\\boxe{18"]
    scores = rm.score(prompts, responses)
    with torch.no_grad():
        alone = [token_values(model, torch.tensor([encode_pair(rm.tokenizer, p, r)]))[0, -1].item()
                 for p, r in zip(prompts, responses)]
    assert scores == pytest.approx(alone, rel=1e-5, abs=1e-6)
    assert scores[0] > scores[1] and scores[0] > scores[2]  # the short form wins
    assert rm.version == read_stamp(tmp_path / "rm")["version"] and rm.version_id == int(rm.version[:8], 16)
    with pytest.raises(ValueError, match="one prompt per response"):
        rm.score(prompts, responses[:2])


def test_a_model_without_a_trained_head_is_refused(tmp_path):
    from rlbench.models import build_model, save_pretrained

    with pytest.raises(ValueError, match="no such directory"):
        RewardModel(tmp_path / "nope")
    save_pretrained(build_model("tiny"), None, tmp_path)
    with pytest.raises(ValueError, match="no tokenizer files"):
        RewardModel(tmp_path)
    from rlbench.data.tokenizer import build_tokenizer

    save_pretrained(build_model("tiny"), build_tokenizer(128), tmp_path)  # a causal LM: no trained head
    with pytest.raises(ValueError, match=r"\['Qwen3ForCausalLM'\], not a value model.*rlbench rm"):
        RewardModel(tmp_path)


def test_rm_config_errors_name_the_flag(prefs, capsys):
    assert cli_main(["rm", "--epochs", "1"]) == 2
    assert "needs data" in capsys.readouterr().err
    assert cli_main(["rm", "--data", prefs, "--eval-fraction", "1.5"]) == 2
    assert "--eval-fraction=1.5 must be in (0, 1)" in capsys.readouterr().err
    with pytest.raises(ValueError, match="device='tpu'"):
        RMTrainConfig(data=prefs, device="tpu")
