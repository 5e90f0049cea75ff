#!/usr/bin/env bash
# Multi-turn GRPO with tool calling on a local Qwen3 checkpoint, one GPU, colocated (docs/multiturn.md).
#   MODEL=/models/Qwen3-0.6B DATA=data/train.jsonl EVAL_DATA=data/eval.jsonl bash examples/tool_use.sh
# The model writes <tool_call>{"name": ..., "arguments": {...}}</tool_call>; the tool's output comes back as a
# <tool_response> observation (loss mask 0) and the model goes on. Your prompts should tell the model which tools it
# has (Qwen's chat template renders a `tools=` list into the system prompt). Extra flags override any below.
set -euo pipefail
MODEL=${MODEL:-/models/Qwen3-0.6B}      # any HF causal-LM directory: config.json + safetensors + tokenizer
DATA=${DATA:-data/train.jsonl}          # one JSON object per line: {"prompt": ..., "label": ...}
EVAL_DATA=${EVAL_DATA:-data/eval.jsonl} # held-out prompts, same keys

TOOL_ARGS=(
  --custom-generate-function-path rlbench.rollout.multiturn:generate   # slime's flag; default: single turn
  --tools calculator                    # registered names or module.path:function (the function's name is the tool's)
  --max-turns 4                         # generation turns per sample; still calling after the last: truncated
  --max-turn-tokens 512                 # tokens one turn may sample
  --tool-timeout 5                      # seconds per call (a worker thread); a hang becomes an error observation
)
ROLLOUT_ARGS=(
  --hf-checkpoint "$MODEL"
  --prompt-data "$DATA" --input-key prompt --label-key label
  --apply-chat-template
  --rm-type math                        # reads what the model wrote (observations left out of Sample.response)
  --num-rollout 100
  --rollout-batch-size 32 --n-samples-per-prompt 8
  --rollout-max-response-len 2048       # the whole response: every turn and every observation
  --rollout-temperature 1.0
  --global-batch-size 256
)
EVAL_ARGS=(
  --eval-prompt-data "$EVAL_DATA" --eval-interval 10   # eval runs the same multi-turn generate function
  --n-samples-per-eval-prompt 4 --eval-pass-k 1 4
)
PERF_ARGS=(
  --use-dynamic-batch-size --max-tokens-per-gpu 16384
  --engine-max-seq-len 4096             # prompt + every turn + every observation
)

exec rlbench train --preset qwen3_0p6b_gpu \
  "${TOOL_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${EVAL_ARGS[@]}" "${PERF_ARGS[@]}" "$@"
