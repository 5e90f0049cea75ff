#!/usr/bin/env bash
# The GPU verification suite in one device call on a 2×H200 host. Lanes run in parallel on separate GPUs;
# every part has its own timeout; logs and JSON land in $OUT. Usage: bash benchmarks/gpu_suite.sh PART...
#   fsdp2    4B-shape FSDP step on both GPUs (torchrun), runs alone first
#   lane0    GPU0: rollout benchmark (engine vs HF generate), then the colocated GRPO loop (tests/test_e2e_gpu.py)
#   lane1    GPU1: FSDP + packed-attention GPU tests, then the 0.6B training benchmark
#   mk       GPU0: the batch-1 decode megakernel: GPU tests and its CPU-interpreter tests, kernel alone (PDL vs grid barriers, Gluon vs Triton stages), decode step vs compiled
#   attend   GPU0: the megakernel's attention: its GPU tests, kernel alone at attention-grid boundaries, decode step
#   extra    GPU1 after lane1 (add it only when there is time): rollout GPU tests, decode variants, 4B training, packing
# One-GPU parts (GPU0, in the order given; each alone fits one call with the others skipped):
#   splitkv  the split-KV decode attention's GPU test, then the compiled shared-prefix rollout with SDPA vs split_kv
#   loop     `rlbench bench e2e` 0.6B shape: defaults, --fast, the true on-policy mode and TRL, cold caches
#   warm     the same without TRL on the caches `loop` left: the warm-cache first step
#   gputests the rollout, FSDP and e2e GPU tests
#   demo     `rlbench demo --device cuda --seed 0` (issue 51): the GPU warm start built on a cold cache, 100 GRPO steps,
#            eval pass@1 / pass@8 every 10, metrics and curve.png in $OUT/demo (estimated 3-4 min on one H100)
#   others   the GPU tests no other part runs: every architecture on CUDA, the log-prob kernels' memory, CP's kernel
#            path, megatron beside FSDP (tests/test_gpu_paths.py checks that every GPU test module is in some part)
#   loop4b   `rlbench bench e2e` 4B shape, defaults and TRL (the memory plan's peak per phase, the ratio to TRL)
#   top      the true on-policy GPU tests (engine vs trainer bit for bit, kernels), the no-host-sync train test, then the mode beside the defaults
#            with each one's rollout and train phase profiled (`--profile`)
#   top4b    the mode beside the defaults at the 4B shape through the real loop (bits and cost)
#   notebooks  the notebooks under nbval with RLBENCH_SMOKE=0, one after the other, 4 min each at most (04's 500-step
#            SFT warm start takes minutes): all of them, or those whose names start with $NOTEBOOKS ("01 02 03"), so
#            they can be spread over calls;
#            the `%%gpu_only` cells run (they skip on a CPU) and the live cells use the Qwen3-0.6B shape; needs the
#            notebook wheels below in .whl/
# Two-GPU parts (a 2-GPU kind):
#   cp2      issue 31: the 4B cp-oom sweep with AC, emulated on GPU0 (the one-GPU prediction), then real on both GPUs
#            (torchrun: cp1 = dp2, cp2 = dp1 x cp2), then a 3-step GRPO loop at cp=2 with 8k responses (Ray, colocated)
#   fvm      issue 32: FSDP dp2 vs megatron TP2 on 2 colocated Ray actors, 20 GRPO steps from one warm start
#   fvm2     issue 32, second call: megatron PP2 in the same comparison, then the Ray paths with --train-backend
#            megatron: colocated 2+2 (TP2) and disaggregated 1+1, 3 steps each, every weight sync verified bit for bit
# Wheels the GPU machine lacks come carried in .whl/ (git-ignored; `carry: [".whl"]`; the machine runs Python 3.12):
# TRL for `loop`/`loop4b`, and math-verify, which the arithmetic task's `math` reward needs for any answer that is
# not a boxed integer (every GRPO run here: cp2's loop, fvm, fvm2; sympy comes with torch):
#   pip download -d .whl --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform any trl==1.16.0 datasets==4.8.5 'dill<0.4.1' 'multiprocess<0.70.19' xxhash \
#     math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
# The notebooks part also needs nbval, a kernel, ipywidgets and plotly (+ anywidget for FigureWidget), at the venv's
# versions, without the machine's own pytest/packaging/typing_extensions:
#   pip download -d .whl --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any nbval==0.11.0 coverage==7.18.0 \
#     nbformat==5.11.1 fastjsonschema==2.22.3 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 \
#     rpds-py==2026.9.1 attrs==26.1.0 jupyter_client==8.10.0 jupyter_core==5.9.1 platformdirs==4.14.9 \
#     python-dateutil==4.0.0 pyzmq==27.3.0 tornado==6.6.1 traitlets==5.16.1 ipykernel==7.4.0 comm==0.2.3 \
#     debugpy==1.8.22 psutil==7.2.2 nest-asyncio2==1.7.4 ipython==9.19.1 ipython_pygments_lexers==1.1.1 jedi==0.20.1 \
#     parso==0.8.7 matplotlib-inline==0.2.2 prompt_toolkit==3.0.53 wcwidth==0.9.5 pexpect==4.9.0 ptyprocess==0.7.0 \
#     stack_data==0.6.3 executing==2.3.0 asttokens==3.0.2 pure_eval==0.2.4 pygments==2.21.0 ipywidgets==8.1.9 \
#     widgetsnbextension==4.0.16 jupyterlab_widgets==3.0.17 plotly==7.1.0 narwhals==2.29.0 anywidget==0.11.0 psygnal==0.16.1
set -u
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl; fi
run() { local name=$1 gpu=$2 limit=$3; shift 3
  CUDA_VISIBLE_DEVICES=$gpu timeout "$limit" bash -c "$*" >"$OUT/$name.log" 2>&1; echo "[$name rc=$?]" >>"$OUT/$name.log"; }
T=${T_SCALE:-1}  # scale every limit (e.g. T_SCALE=0.8 for a short call)
lim() { python3 -c "print(int($1*$T))"; }
for part in "$@"; do case $part in
  fsdp2) run fsdp2 0,1 "$(lim 150)" "torchrun --nproc_per_node 2 benchmarks/train.py --preset qwen3-4b-shape \
           --attn flex_attention --compile --steps 3 --warmup 2 --json $OUT/train2.jsonl" ;;
  lane0) ( run rollout 0 "$(lim 300)" "python3 benchmarks/rollout.py --device cuda --preset qwen3-0.6b-shape \
               --batch-sizes 1 16 64 256 --prompt-len 512 --new-tokens 1024 --hf-new-tokens 256 --out $OUT/rollout.json"
           run e2e 0 "$(lim 180)" "python3 -m pytest -q -s -m gpu tests/test_e2e_gpu.py tests/test_models.py" ) & ;;
  lane1) ( run fsdp1 1 "$(lim 300)" "python3 -m pytest -m gpu tests/test_fsdp_gpu.py tests/test_packing_attention.py -q -s;
             python3 benchmarks/train.py --preset qwen3-0.6b-shape --attn flex_attention --compile --steps 3 --warmup 2 --json $OUT/train.jsonl" ) & ;;
  mk) run mk 0 "$(lim 600)" "python3 -m pytest -q -s -m 'gpu or interpreted' tests/test_megakernel.py;
        python3 benchmarks/megakernel.py --pos 256 1024 1500 --sync pdl barrier --gluon 1 0;
        python3 benchmarks/megakernel.py --preset qwen3-4b-shape --pos 1024 --iters 50 --sync pdl barrier;
        python3 benchmarks/decode_profile.py --kv 256 1024 --batch 1 --megakernel 0 1 --megakernel-sync pdl barrier --megakernel-gluon 0 1;
        python3 benchmarks/decode_profile.py --kv 256 1024 --batch 1 --megakernel 1 --megakernel-head 0 1 --modes sample greedy;
        python3 benchmarks/decode_profile.py --preset qwen3-4b-shape --kv 1024 --batch 1 --megakernel 0 1 --steps 30;
        python3 benchmarks/rollout.py --device cuda --preset qwen3-0.6b-shape --batch-sizes 1 --prompt-len 512 \
          --new-tokens 1024 --hf-new-tokens 256 --megakernel --out $OUT/rollout_mk.json" ;;
  attend) ( run attend_tests 0 "$(lim 210)" "python3 -m pytest -q -s -m gpu tests/test_megakernel.py -k 'rounds_like or same_bits or survives or pdl'"
            run attend_mk 0 "$(lim 150)" "python3 benchmarks/megakernel.py --pos 256 960 1024 1500 2100 2500"
            run attend_step 0 "$(lim 180)" "python3 benchmarks/decode_profile.py --kv 256 1024 1536 --batch 1 --megakernel 1 \
              --modes sample greedy" ) & ;;
  extra) run extra 1 "$(lim 400)" "python3 -m pytest -m gpu tests/test_rollout_gpu.py -q -s;
           python3 benchmarks/decode_profile.py --preset qwen3-0.6b-shape --kv 256 1024 --batch 1 --fused 1 --decode-attention sdpa split --gemv-batch1 0 1;
           python3 benchmarks/train.py --preset qwen3-4b-shape --attn flex_attention --compile --steps 3 --warmup 2 --json $OUT/train.jsonl;
           python3 benchmarks/packing.py --gpu --attn sdpa flex_attention --out $OUT/packing_gpu.json" ;;
  splitkv) run splitkv 0 "$(lim 300)" "python3 -m pytest -q -x -m gpu tests/test_split_kv.py && python3 benchmarks/shared_prefix.py \
             --device cuda --preset qwen3-0.6b-shape --compile 1 --repeats 1 --decode-attention sdpa split_kv --out $OUT/shared_prefix.json" ;;
  loop) run loop 0 "$(lim 400)" "python3 -m rlbench.cli bench e2e --preset qwen3-0.6b-shape --steps 3 --trl --fast --true-on-policy \
          --model-dir /tmp/e2e-0.6b --out $OUT/e2e.json" ;;
  warm) run warm 0 "$(lim 200)" "python3 -m rlbench.cli bench e2e --preset qwen3-0.6b-shape --steps 3 --no-trl --fast \
          --model-dir /tmp/e2e-0.6b --out $OUT/e2e_warm.json" ;;
  loop4b) run loop4b 0 "$(lim 560)" "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 -m rlbench.cli bench e2e \
            --preset qwen3-4b-shape --steps 2 --trl --out $OUT/e2e_4b.json" ;;
  top) run top 0 "$(lim 480)" "python3 -m pytest -q -m gpu tests/test_true_on_policy_gpu.py tests/test_numerics_gpu.py -k 'not matmul';
         python3 -m pytest -q -m gpu tests/test_e2e_gpu.py -k never_wait;
         python3 -m rlbench.cli bench e2e --preset qwen3-0.6b-shape --steps 3 --no-trl --true-on-policy --profile \
           --model-dir /tmp/e2e-0.6b --out $OUT/e2e_top.json" ;;
  top4b) run top4b 0 "$(lim 560)" "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 -m rlbench.cli bench e2e \
            --preset qwen3-4b-shape --steps 2 --no-trl --true-on-policy --out $OUT/e2e_top_4b.json" ;;
  cp2) run cp_emulated 0 "$(lim 200)" "python3 -m rlbench.experiments.cp_oom --preset qwen3-4b-shape --cp 1 2 --ac on \
         --start-len 8192 --max-len 262144 --resolution 4096 --time-budget 180 --out $OUT/cp_oom_emulated"
       run cp_2gpu 0,1 "$(lim 380)" "torchrun --nproc_per_node 2 -m rlbench.experiments.cp_oom --preset qwen3-4b-shape \
         --cp 1 2 --ac on --start-len 8192 --max-len 262144 --resolution 4096 --time-budget 340 --out $OUT/cp_oom_2gpu"
       run cp_loop 0,1 "$(lim 400)" "python3 -m rlbench.cli train --preset qwen3_0p6b_gpu --hf-checkpoint qwen3-4b-shape \
         --backend ray --context-parallel-size 2 --actor-num-gpus-per-node 2 --colocate --num-rollout 3 \
         --rollout-batch-size 1 --n-samples-per-prompt 2 --global-batch-size 2 --rollout-max-response-len 8192 \
         --engine-max-seq-len 8448 --ignore-eos --gradient-checkpointing --max-tokens-per-gpu 16384 --with-entropy \
         --entropy-coef 0.001 --skip-eval-before-train --eval-interval 1000 --metrics-jsonl $OUT/cp2_loop.jsonl" ;;
  fvm) run fvm 0,1 "$(lim 560)" "python3 -m rlbench.cli experiment fsdp-vs-megatron --device cuda --gpus 2 --steps 20 \
         --out $OUT/fsdp_vs_megatron_2gpu_tp2.json" ;;
  fvm2) run fvm_pp2 0,1 "$(lim 260)" "python3 -m rlbench.cli experiment fsdp-vs-megatron --device cuda --gpus 2 --pp 2 \
          --backends megatron --steps 20 --out $OUT/fsdp_vs_megatron_2gpu_pp2.json"
        common="python3 -m rlbench.cli train --preset qwen3_0p6b_gpu --hf-checkpoint qwen3-0.6b-shape --backend ray \
          --train-backend megatron --num-rollout 3 --check-weight-update-equal --skip-eval-before-train --eval-interval 1000"
        run megatron_ray_coloc 0,1 "$(lim 150)" "$common --tensor-model-parallel-size 2 --actor-num-gpus-per-node 2 \
          --colocate --metrics-jsonl $OUT/megatron_ray_coloc.jsonl"
        run megatron_ray_disagg 0,1 "$(lim 150)" "$common --actor-num-gpus-per-node 1 --no-colocate --rollout-num-gpus 1 \
          --metrics-jsonl $OUT/megatron_ray_disagg.jsonl" ;;
  notebooks) for nb in $(for n in ${NOTEBOOKS:-0}; do ls notebooks/"$n"*.ipynb; done); do  # one limit each
               run "nb_$(basename "$nb" .ipynb)" 0 "$(lim 240)" "RLBENCH_SMOKE=0 python3 -m pytest -q -p no:cacheprovider \
                 --nbval-lax --nbval-cell-timeout 230 $nb"; done ;;
  demo) run demo 0 "$(lim 560)" "python3 -m rlbench.cli demo --device cuda --seed 0 --run-dir $OUT/demo" ;;
  gputests) run gputests 0 "$(lim 240)" "python3 -m pytest -q -m gpu tests/test_rollout_gpu.py tests/test_fsdp_gpu.py tests/test_e2e_gpu.py" ;;
  others) run others 0 "$(lim 400)" "python3 -m pytest -q -m gpu tests/test_architectures.py tests/test_algorithms_logprobs.py \
            tests/test_cp_gpu.py tests/test_megatron_gpu.py" ;;
  *) echo "unknown part $part"; exit 2 ;;
esac; done
wait
tail -n 12 "$OUT"/*.log
