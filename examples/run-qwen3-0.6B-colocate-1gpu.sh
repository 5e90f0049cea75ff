#!/usr/bin/env bash
# GRPO on a local Qwen3-0.6B checkpoint, trainer and rollout engine colocated on one GPU (one process).
#   MODEL=/models/Qwen3-0.6B DATA=data/train.jsonl EVAL_DATA=data/eval.jsonl bash examples/run-qwen3-0.6B-colocate-1gpu.sh
# Extra flags after the script override any below (the last one wins); `--print-config` shows the result.
set -euo pipefail
MODEL=${MODEL:-/models/Qwen3-0.6B}      # any HF causal-LM directory: config.json + safetensors + tokenizer
DATA=${DATA:-data/train.jsonl}          # one JSON object per line: {"prompt": ..., "label": ...}
EVAL_DATA=${EVAL_DATA:-data/eval.jsonl} # held-out prompts, same keys

CKPT_ARGS=(
  --hf-checkpoint "$MODEL"              # the policy; also the tokenizer
  --save runs/qwen3-0.6B-grpo/ckpt      # atomic DCP checkpoints (iter_N/ + tracker)
  --save-interval 20                    # every 20 rollouts
)
ROLLOUT_ARGS=(
  --prompt-data "$DATA" --input-key prompt --label-key label
  --apply-chat-template                 # str prompts become [{"role": "user", ...}] through the chat template
  --rm-type math                        # \boxed{} answer vs label (rlbench/rewards.py; "module:function" for yours)
  --num-rollout 100                     # RL steps
  --rollout-batch-size 32               # prompts per rollout
  --n-samples-per-prompt 8              # GRPO group size: 256 samples per rollout
  --rollout-max-response-len 1024
  --rollout-temperature 1.0
  --global-batch-size 256               # samples per optimizer step: one step per rollout (on-policy)
)
EVAL_ARGS=(
  --eval-prompt-data "$EVAL_DATA"       # without it there is no eval (never the preset's synthetic set)
  --eval-interval 10                    # and once before training (--skip-eval-before-train to skip)
  --n-samples-per-eval-prompt 4 --eval-pass-k 1 4
)
PERF_ARGS=(
  --use-dynamic-batch-size              # micro-batches packed up to a token budget, not a sample count
  --max-tokens-per-gpu 16384
  --engine-max-seq-len 2048             # prompt + response budget of the engine's KV slots
)
GRPO_ARGS=(
  --advantage-estimator grpo
  --eps-clip 0.2 --eps-clip-high 0.28   # clip-higher
)
OPTIMIZER_ARGS=(
  --lr 1e-6 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98 --clip-grad 1.0
)

exec rlbench train --preset qwen3_0p6b_gpu \
  "${CKPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${EVAL_ARGS[@]}" "${PERF_ARGS[@]}" "${GRPO_ARGS[@]}" \
  "${OPTIMIZER_ARGS[@]}" "$@"
