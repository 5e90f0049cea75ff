#!/usr/bin/env bash
# Side by side on one GPU: the tree before the restructuring (gpu_baseline/, commit da6b7f1) and after (.).
set -u
export PYTHONUNBUFFERED=1
for tree in gpu_baseline .; do
  tag=$([ "$tree" = . ] && echo after || echo before)
  (cd "$tree" && PYTHONPATH=$PWD timeout 200 python3 benchmarks/decode_profile.py --kv 256 1024 --batch 1 --megakernel 1 --modes sample greedy) > "$OUT/decode_$tag.log" 2>&1
  (cd "$tree" && PYTHONPATH=$PWD timeout 200 python3 benchmarks/rollout.py --device cuda --preset qwen3-0.6b-shape --batch-sizes 1 64 \
     --prompt-len 512 --new-tokens 1024 --skip-hf --out "$OUT/rollout_$tag.json") > "$OUT/rollout_$tag.log" 2>&1
done
for f in "$OUT"/decode_*.log "$OUT"/rollout_*.log; do echo "== $f"; tail -n 8 "$f"; done
