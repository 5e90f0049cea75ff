#!/usr/bin/env bash
# The GPU verification suite in one device call (2×H200 host): independent parts run on separate GPUs
# at once, every part under its own timeout, logs under $OUT. Usage: bash benchmarks/gpu_suite.sh PART...
# Parts: rollout (GPU0), fsdp1 (GPU1), fsdp2 (both GPUs, after the others), packing, trainer.
set -u
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl; fi
run() { local name=$1 gpu=$2 limit=$3; shift 3
  ( export CUDA_VISIBLE_DEVICES=$gpu; timeout "$limit" bash -c "$*" >"$OUT/$name.log" 2>&1; echo "[$name rc=$?]" >>"$OUT/$name.log" ) ; }
for part in "$@"; do case $part in
  rollout) run rollout 0 380 "python3 -m pytest -m gpu tests/test_rollout_gpu.py -q -s -x;
           python3 benchmarks/rollout.py --device cuda --preset qwen3-0.6b-shape --batch-sizes 1 16 64 256 \
             --prompt-len 512 --new-tokens 1024 --hf-new-tokens 256 --out $OUT/rollout.json" & ;;
  fsdp1) run fsdp1 1 380 "python3 -m pytest -m gpu tests/test_fsdp_gpu.py -q -s -x;
           python3 benchmarks/train.py --preset qwen3-0.6b-shape --attn flex_attention --compile --steps 3 --warmup 2 --json $OUT/train.jsonl;
           python3 benchmarks/train.py --preset qwen3-4b-shape --attn flex_attention --compile --steps 3 --warmup 2 --json $OUT/train.jsonl" & ;;
  packing) run packing 1 240 "python3 benchmarks/packing.py --gpu --attn sdpa flex_attention --out $OUT/packing_gpu.json" ;;
  trainer) run trainer 0 300 "python3 -m rlbench.cli gpu-demo --out $OUT/trainer.json" & ;;
  fsdp2) wait; run fsdp2 0,1 170 "torchrun --nproc_per_node 2 benchmarks/train.py --preset qwen3-4b-shape --attn flex_attention --compile --steps 3 --warmup 2 --json $OUT/train2.jsonl" ;;
  *) echo "unknown part $part"; exit 2 ;;
esac; done
wait
tail -n 25 "$OUT"/*.log
