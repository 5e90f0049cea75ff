#!/usr/bin/env bash
# GRPO on a local Qwen3-4B checkpoint, disaggregated: TRAIN_GPUS GPUs train (FSDP2), ROLLOUT_GPUS other GPUs
# generate; weights go from trainer to engines over NCCL after every update.
#   TRAIN_GPUS=4 ROLLOUT_GPUS=4 MODEL=/models/Qwen3-4B DATA=data/train.jsonl EVAL_DATA=data/eval.jsonl \
#     bash examples/run-qwen3-4B-disaggregated.sh
# Extra flags after the script override any below (the last one wins); `--print-config` shows the result.
set -euo pipefail
TRAIN_GPUS=${TRAIN_GPUS:-4}
ROLLOUT_GPUS=${ROLLOUT_GPUS:-4}
MODEL=${MODEL:-/models/Qwen3-4B}
DATA=${DATA:-data/train.jsonl}
EVAL_DATA=${EVAL_DATA:-data/eval.jsonl}

CLUSTER_ARGS=(
  --backend ray
  --actor-num-nodes 1 --actor-num-gpus-per-node "$TRAIN_GPUS"   # trainer ranks
  --rollout-num-gpus "$ROLLOUT_GPUS"    # engines on GPUs of their own ...
  --no-colocate                         # ... not shared with the trainer
  --rollout-num-gpus-per-engine 1       # one engine per rollout GPU
  # --async-rollout                     # generate rollout k+1 while training on k (one step off-policy)
)
CKPT_ARGS=(
  --hf-checkpoint "$MODEL"
  --save runs/qwen3-4B-disagg/ckpt --save-interval 20
)
ROLLOUT_ARGS=(
  --prompt-data "$DATA" --input-key prompt --label-key label --apply-chat-template
  --rm-type math
  --num-rollout 100
  --rollout-batch-size 64 --n-samples-per-prompt 8
  --rollout-max-response-len 2048 --rollout-temperature 1.0
  --global-batch-size 512               # a multiple of TRAIN_GPUS
)
EVAL_ARGS=(
  --eval-prompt-data "$EVAL_DATA" --eval-interval 10
  --n-samples-per-eval-prompt 4 --eval-pass-k 1 4
)
PERF_ARGS=(
  --use-dynamic-batch-size --max-tokens-per-gpu 16384 --gradient-checkpointing
  --engine-max-seq-len 4096
)
GRPO_ARGS=(
  --advantage-estimator grpo --eps-clip 0.2 --eps-clip-high 0.28
)
OPTIMIZER_ARGS=(
  --lr 1e-6 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98 --clip-grad 1.0
)

exec rlbench train --preset qwen3_0p6b_gpu \
  "${CLUSTER_ARGS[@]}" "${CKPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${EVAL_ARGS[@]}" "${PERF_ARGS[@]}" \
  "${GRPO_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" "$@"
