#!/usr/bin/env bash
# A reward model from preference pairs, then GRPO with it beside the rule reward (docs/reward_model.md).
#   MODEL=runs/sft DATA=data/prefs.jsonl OUT=runs/rm bash examples/train_rm.sh
# Without DATA the synthetic arithmetic preferences (rlbench/data/preferences.py, a hidden rule) are written first.
# Extra flags after the script go to `rlbench rm` (the last one wins).
set -euo pipefail
MODEL=${MODEL:-tiny}                    # where the RM starts: an HF causal-LM directory (e.g. the SFT policy) or a preset
DATA=${DATA:-data/prefs.jsonl}          # one JSON object per line: {"prompt": ..., "chosen": ..., "rejected": ...}
OUT=${OUT:-runs/rm}                     # HF token-classification directory + tokenizer + version.json (the version)
LR=${LR:-1e-3}                          # for the tiny preset; ~1e-5 for a real checkpoint

if [ ! -f "$DATA" ]; then
  python -c "import sys; from rlbench.data.preferences import make_arithmetic_preferences as m; \
from rlbench.data.tasks import write_jsonl; write_jsonl(m(2000, level=1, seed=0), sys.argv[1])" "$DATA"
fi

RM_ARGS=(
  --data "$DATA" --hf-checkpoint "$MODEL" --out "$OUT"
  --eval-fraction 0.1                   # held-out pairs: rm/eval_accuracy after every epoch
  --epochs 2 --batch-size 32
  --lr "$LR" --warmup-steps 5 --clip-grad 1.0
  --max-tokens 4096                     # tokens per packed micro-batch (a pair stays in one)
)
rlbench rm "${RM_ARGS[@]}" "$@"

echo "serve it: rlbench train --reward-model $OUT --reward-weights math:1,rm:0.5 ..."
