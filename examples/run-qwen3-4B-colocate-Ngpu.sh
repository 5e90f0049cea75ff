#!/usr/bin/env bash
# GRPO on a local Qwen3-4B checkpoint over N GPUs of one node, colocated: every GPU holds one FSDP2 trainer rank
# and one rollout engine; they take turns (the trainer state is parked in host memory during rollout).
#   NUM_GPUS=8 MODEL=/models/Qwen3-4B DATA=data/train.jsonl EVAL_DATA=data/eval.jsonl \
#     bash examples/run-qwen3-4B-colocate-Ngpu.sh
# Extra flags after the script override any below (the last one wins); `--print-config` shows the result.
set -euo pipefail
NUM_GPUS=${NUM_GPUS:-8}
MODEL=${MODEL:-/models/Qwen3-4B}
DATA=${DATA:-data/train.jsonl}
EVAL_DATA=${EVAL_DATA:-data/eval.jsonl}

CLUSTER_ARGS=(
  --backend ray                         # Ray actors: one trainer rank per GPU (docs/distributed.md)
  --actor-num-nodes 1
  --actor-num-gpus-per-node "$NUM_GPUS" # FSDP2 shards the model over these ranks
  --rollout-num-gpus "$NUM_GPUS"        # one engine per GPU ...
  --colocate                            # ... on the trainer's GPUs
  --offload                             # trainer state to host during rollout, KV cache freed during training
)
CKPT_ARGS=(
  --hf-checkpoint "$MODEL"
  --save runs/qwen3-4B-grpo/ckpt --save-interval 20
)
ROLLOUT_ARGS=(
  --prompt-data "$DATA" --input-key prompt --label-key label --apply-chat-template
  --rm-type math
  --num-rollout 100
  --rollout-batch-size 64 --n-samples-per-prompt 8   # 512 samples per rollout
  --rollout-max-response-len 2048 --rollout-temperature 1.0
  --global-batch-size 512               # a multiple of the DP size (NUM_GPUS)
)
EVAL_ARGS=(
  --eval-prompt-data "$EVAL_DATA" --eval-interval 10
  --n-samples-per-eval-prompt 4 --eval-pass-k 1 4
)
PERF_ARGS=(
  --use-dynamic-batch-size --max-tokens-per-gpu 16384
  --gradient-checkpointing              # activation checkpointing per decoder layer (4B at 16k tokens/GPU)
  --engine-max-seq-len 4096
)
GRPO_ARGS=(
  --advantage-estimator grpo --eps-clip 0.2 --eps-clip-high 0.28
  --use-kl-loss --kl-loss-coef 0.001 --kl-loss-type low_var_kl
  --ref-load "$MODEL"                   # the KL reference: the starting checkpoint
)
OPTIMIZER_ARGS=(
  --lr 1e-6 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98 --clip-grad 1.0
)

exec rlbench train --preset qwen3_0p6b_gpu \
  "${CLUSTER_ARGS[@]}" "${CKPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${EVAL_ARGS[@]}" "${PERF_ARGS[@]}" \
  "${GRPO_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" "$@"
