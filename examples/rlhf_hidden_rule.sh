#!/usr/bin/env bash
# Classic RLHF on the synthetic preference task, from the CLI on a CPU (docs/reward_model.md, notebook 05): a verbose
# SFT warm start, a reward model trained on preferences made by a hidden rule, then PPO with a critic against the RM,
# the hidden rule logged (rollout/rule_reward) and evaluated (eval/reward) beside the RM's score. ~2 min on 2 cores.
#   bash examples/rlhf_hidden_rule.sh                   # WORK=runs/rlhf; steps already done there are reused
# Extra flags after the script go to `rlbench train` (the last one wins); `--print-config` shows the result.
set -euo pipefail
WORK=${WORK:-runs/rlhf}
SFT_STEPS=${SFT_STEPS:-600}             # upper bound: SFT stops at sampled pass@1 >= 0.3 (~240 steps)
N_PAIRS=${N_PAIRS:-800}                 # preference pairs for the RM (a tenth held out)
mkdir -p "$WORK"

# 1. the policy: tiny, 1-digit addition, half the SFT solutions written long ("The answer is \boxed{8}")
[ -f "$WORK/sft/config.json" ] || python -m rlbench.sft --preset tiny --level 1 --long-form-share 0.5 \
  --batch-size 32 --eval-every 20 --num-eval 32 --max-steps "$SFT_STEPS" --num-threads 1 --out "$WORK/sft"

# 2. the reward model: pairs labelled by the hidden rule (short form +1, correct answer +0.5), Bradley-Terry
if [ ! -f "$WORK/rm/version.json" ]; then
  python -c "import sys; from rlbench.data.preferences import make_arithmetic_preferences as m; \
from rlbench.data.tasks import write_jsonl; write_jsonl(m(int(sys.argv[2]), level=1, seed=0), sys.argv[1])" \
    "$WORK/prefs.jsonl" "$N_PAIRS"
  rlbench rm --data "$WORK/prefs.jsonl" --hf-checkpoint tiny --out "$WORK/rm" --epochs 1 --lr 1e-3 --num-threads 1
fi

# 3. prompts (1-digit addition; eval drawn with another seed), then PPO against the RM
[ -f "$WORK/eval.jsonl" ] || python -c "import sys; from rlbench.data.tasks import arithmetic_level as lv, \
make_arithmetic as m, write_jsonl as w; w(m(2000, lv(1), seed=0), sys.argv[1]); w(m(32, lv(1), seed=1), sys.argv[2])" \
  "$WORK/train.jsonl" "$WORK/eval.jsonl"
REWARD_ARGS=(
  --reward-model "$WORK/rm"             # the training reward: the RM's score ...
  --reward-weights rm:1                 # ... alone (rm:1,math:1 mixes the verifiable reward in)
  --rm-type rlbench.data.preferences:hidden_rule_score   # the rule reward: logged and evaluated, not trained on
  --metadata-key none                   # the task rows name rm_type "math", which would replace the rule
)
TASK_ARGS=(
  --hf-checkpoint "$WORK/sft" --apply-chat-template
  --prompt-data "$WORK/train.jsonl" --eval-prompt-data "$WORK/eval.jsonl" --input-key prompt --label-key label
  --num-rollout 20 --rollout-batch-size 16 --n-samples-per-prompt 8 --global-batch-size 64
  --rollout-max-response-len 28 --engine-max-seq-len 52   # prompts: 24 tokens; a long form: up to 25 (52 -> 64)
  --eval-interval 5 --n-samples-per-eval-prompt 8 --eval-pass-k 1 --eval-max-response-len 28
)
PPO_ARGS=(
  --advantage-estimator gae --lambd 0.95 --normalize-advantages
  --ref-load "$WORK/sft"                # the reference of the KL-in-reward
  --kl-coef 0.05 --kl-ctl-type adaptive --kl-target 0.1   # β steered towards a per-sample KL of 0.1
  --critic-lr 1e-3 --lr 2e-4
)
exec rlbench train --preset cpu_test --run-dir "$WORK/ppo" \
  "${REWARD_ARGS[@]}" "${TASK_ARGS[@]}" "${PPO_ARGS[@]}" "$@"
