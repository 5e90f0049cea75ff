"""CLI: slime-named flags exist, map onto the right config fields, and bad combinations fail clearly."""

from __future__ import annotations

import json

import pytest

from rlbench.cli import build_parser, main, preset_config
from rlbench.cli_flags import config_flags

SLIME_FLAGS = [
    "--train-backend", "--hf-checkpoint", "--prompt-data", "--input-key", "--label-key", "--rm-type",
    "--n-samples-per-prompt", "--rollout-batch-size", "--global-batch-size", "--use-dynamic-batch-size",
    "--max-tokens-per-gpu", "--advantage-estimator", "--eps-clip", "--eps-clip-high", "--use-kl-loss",
    "--kl-loss-coef", "--kl-loss-type", "--entropy-coef", "--use-tis", "--lr", "--lr-decay-style", "--colocate",
    "--save", "--save-interval", "--num-rollout", "--rollout-max-response-len", "--rollout-temperature",
    "--eval-interval", "--load", "--ref-load", "--micro-batch-size", "--balance-data", "--use-rollout-logprobs",
    "--update-weight-buffer-size", "--rollout-shuffle", "--rollout-seed", "--weight-decay", "--adam-beta1",
    "--adam-beta2", "--clip-grad", "--seed", "--eval-prompt-data", "--n-samples-per-eval-prompt",
    "--over-sampling-batch-size", "--check-weight-update-equal", "--context-parallel-size",
    "--gradient-checkpointing", "--fsdp-cpu-offload", "--attn-implementation", "--rollout-max-prompt-len",
    "--lr-warmup-iters", "--lr-decay-iters", "--min-lr", "--kl-coef", "--use-unbiased-kl", "--tis-clip",
    "--tis-clip-low", "--use-opsm", "--opsm-delta", "--skip-eval-before-train", "--apply-chat-template",
    "--metadata-key", "--tensorboard-dir", "--wandb-project", "--eval-temperature", "--eval-max-response-len",
]


def _train_flags() -> set[str]:
    sub = build_parser()._subparsers._group_actions[0].choices["train"]
    return {s for a in sub._actions for s in a.option_strings}


def test_slime_flag_names_exist():
    missing = [f for f in SLIME_FLAGS if f not in _train_flags()]
    assert not missing


def test_every_config_field_has_exactly_one_flag():
    flags = config_flags()
    fields = [(sec, name) for sec, name, _, _ in flags.values()]
    assert len(fields) == len(set(fields))
    assert ("loss", "eps_clip_high") in fields and ("batch", "global_batch_size") in fields
    assert flags["--lr"][:2] == ("backend.optim", "lr")
    assert flags["--engine-max-seq-len"][:2] == ("engine", "max_seq_len")


def _cfg(argv):
    args = build_parser().parse_args(["train", *argv])
    return preset_config(args)


def test_flags_map_onto_fields():
    cfg = _cfg([
        "--preset", "cpu_test", "--hf-checkpoint", "tiny", "--prompt-data", "p.jsonl", "--input-key", "q",
        "--label-key", "a", "--rm-type", "exact", "--n-samples-per-prompt", "4", "--rollout-batch-size", "6",
        "--global-batch-size", "12", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "512",
        "--advantage-estimator", "gspo", "--eps-clip", "0.1", "--eps-clip-high", "0.3", "--use-kl-loss",
        "--kl-loss-coef", "0.02", "--kl-loss-type", "low_var_kl", "--ref-load", "tiny", "--lr", "3e-5",
        "--lr-decay-style", "cosine", "--lr-decay-iters", "50", "--adam-beta2", "0.98", "--save", "/tmp/ck",
        "--save-interval", "2", "--num-rollout", "7", "--rollout-max-response-len", "20",
        "--rollout-temperature", "0.9", "--eval-interval", "3", "--eval-prompt-data", "e.jsonl", "--eval-pass-k", "1", "2",
        "--n-samples-per-eval-prompt", "2", "--update-weight-buffer-size", "1048576", "--check-weight-update-equal",
    ])
    assert cfg.backend.model == "tiny" and cfg.backend.ref_model == "tiny"
    assert (cfg.data.path, cfg.data.input_key, cfg.data.label_key) == ("p.jsonl", "q", "a")
    unset = _cfg(["--preset", "cpu_test", "--label-key", "none", "--metadata-key", "None", "--lr-decay-iters", "NONE"])
    assert (unset.data.label_key, unset.data.metadata_key, unset.backend.optim.decay_steps) == (None, None, None)
    assert (cfg.rollout.rm_type, cfg.rollout.n_samples_per_prompt, cfg.rollout.rollout_batch_size) == ("exact", 4, 6)
    assert (cfg.batch.global_batch_size, cfg.batch.use_dynamic_batch_size, cfg.batch.max_tokens_per_gpu) == (12, True, 512)
    assert (cfg.loss.advantage_estimator, cfg.loss.policy_loss) == ("gspo", "ppo")
    assert (cfg.loss.eps_clip, cfg.loss.eps_clip_high, cfg.loss.kl_loss_coef, cfg.loss.kl_loss_type) == (0.1, 0.3, 0.02, "low_var_kl")
    assert cfg.loss.use_kl_loss
    assert (cfg.backend.optim.lr, cfg.backend.optim.lr_schedule, cfg.backend.optim.betas) == (3e-5, "cosine", (0.9, 0.98))
    assert (cfg.checkpoint.save_dir, cfg.checkpoint.save_interval, cfg.batch.num_rollout) == ("/tmp/ck", 2, 7)
    assert cfg.rollout.max_response_len == 20
    assert cfg.rollout.temperature == 0.9  # the one temperature: sampling, and the backend's log-probs
    assert (cfg.eval.interval, cfg.eval.pass_k, cfg.eval.n_samples_per_prompt) == (3, (1, 2), 2)
    assert (cfg.eval.data_path, cfg.task) == ("e.jsonl", None)  # your data: no synthetic task, your eval file
    assert cfg.weights.bucket_bytes == 1 << 20 and cfg.weights.verify


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--use-kl-loss", "--kl-loss-coef", "0.1"], "need a reference model; set backend.ref_model"),
        (["--global-batch-size", "48"], "is not a multiple of global_batch_size=48"),
        (["--use-rollout-logprobs", "--use-tis"], "exclusive"),
        (["--no-use-dynamic-batch-size", "--micro-batch-size", "5"], "global_batch_size=32 must be divisible by micro_batch_size=5"),
        (["--eval-pass-k", "8"], r"k=\[8\] outside"),
    ],
)
def test_bad_flags_give_one_clear_error(argv, match):
    with pytest.raises(ValueError, match=match):
        _cfg(["--preset", "cpu_test", *argv])


def test_print_config_is_json(capsys):
    assert main(["train", "--preset", "cpu_test", "--hf-checkpoint", "tiny", "--lr", "0.5", "--print-config"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["backend"]["optim"]["lr"] == 0.5 and out["backend"]["model"] == "tiny"


def test_unknown_choice_is_rejected(capsys):
    assert main(["train", "--train-backend", "megatrn", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "--train-backend='megatrn' (did you mean 'megatron'?)" in err
