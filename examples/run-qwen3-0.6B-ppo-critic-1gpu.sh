#!/usr/bin/env bash
# PPO with a critic (GAE, clipped value loss, KL-in-reward) on a local Qwen3-0.6B checkpoint; actor, critic and
# rollout engine colocated on one GPU (one process; the critic is parked with the actor between turns).
#   MODEL=/models/Qwen3-0.6B DATA=data/train.jsonl EVAL_DATA=data/eval.jsonl bash examples/run-qwen3-0.6B-ppo-critic-1gpu.sh
# Extra flags after the script override any below (the last one wins); `--print-config` shows the result.
set -euo pipefail
MODEL=${MODEL:-/models/Qwen3-0.6B}      # any HF causal-LM directory: config.json + safetensors + tokenizer
DATA=${DATA:-data/train.jsonl}          # one JSON object per line: {"prompt": ..., "label": ...}
EVAL_DATA=${EVAL_DATA:-data/eval.jsonl} # held-out prompts, same keys

CKPT_ARGS=(
  --hf-checkpoint "$MODEL"              # the policy; also the tokenizer
  --ref-load "$MODEL"                   # the reference of the KL-in-reward
  --save runs/qwen3-0.6B-ppo/ckpt       # one atomic checkpoint holds actor and critic (iter_N/critic/)
  --save-interval 20
)
ROLLOUT_ARGS=(
  --prompt-data "$DATA" --input-key prompt --label-key label
  --apply-chat-template
  --rm-type math
  --num-rollout 100
  --rollout-batch-size 64               # prompts per rollout
  --n-samples-per-prompt 4              # PPO needs no groups: fewer samples per prompt, more prompts
  --rollout-max-response-len 1024
  --rollout-temperature 1.0
  --global-batch-size 128               # two optimizer steps (critic, then actor) per rollout
)
EVAL_ARGS=(
  --eval-prompt-data "$EVAL_DATA"
  --eval-interval 10
  --n-samples-per-eval-prompt 4 --eval-pass-k 1 4
)
PERF_ARGS=(
  --use-dynamic-batch-size
  --max-tokens-per-gpu 16384
  --engine-max-seq-len 2048
)
PPO_ARGS=(
  --advantage-estimator gae             # builds the critic: the actor's model with a scalar value head
  --gamma 1.0 --lambd 0.95              # GAE over the response tokens (loss-masked spans skipped)
  --normalize-advantages                # whitened over the global batch (all DP ranks)
  --value-clip 0.2                      # clipped value loss around the critic's values before the update
  --kl-coef 0.01 --kl-loss-type k1      # per-token KL to the reference, subtracted from the reward
  --eps-clip 0.2
  --critic-lr 5e-6                      # the critic's own AdamW and schedule (the rest: the actor's flags)
  --critic-lr-warmup-iters 5
  --num-critic-only-steps 2             # the first 2 rollouts train only the critic
)
OPTIMIZER_ARGS=(
  --lr 1e-6 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98 --clip-grad 1.0
)

exec rlbench train --preset qwen3_0p6b_gpu \
  "${CKPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${EVAL_ARGS[@]}" "${PERF_ARGS[@]}" "${PPO_ARGS[@]}" \
  "${OPTIMIZER_ARGS[@]}" "$@"
