# Sourced by the scripts beside it. Run those from the repository root on the GPU machine, after
# `source benchmarks/gpu_env.sh` (docs/benchmarks.md, "How to reproduce").
#
# Shapes of dstrain's built-in GPT (micro batch per GPU x sequence):
#   124m   12 x 768,  12 heads, vocabulary 50,304,  16 x 1024
#   406m   24 x 1024, 16 heads, vocabulary 100,352,  8 x 1024   (the suite's default)
#   615m   20 x 1536, 12 heads, vocabulary 32,000,   4 x 2048
#   913m   16 x 2048, 16 heads, vocabulary 50,304,   4 x 2048
#   1.3b   24 x 2048, 16 heads, vocabulary 50,304,   8 x 1024
#   1.65b  24 x 2304, 18 heads, vocabulary 50,304,   8 x 1024
#   2.65b  32 x 2560, 20 heads, vocabulary 50,304,   4 x 2048
#   3.78b  32 x 3072, 24 heads, vocabulary 50,304,   2 x 2048
#   6.6b   32 x 4096, 32 heads, vocabulary 32,000,   2 x 2048   (past DDP's memory: stage3 on 4 GPUs)
# Hugging Face shapes (suite.py --hf-shape: random weights, built once into ~/.cache/dstrain/bench-hf):
#   qwen2-1.5b  Qwen2.5-1.5B: 28 x 1536, 12 heads (2 KV), vocabulary 151,936, tied, 4 x 2048
#   llama-1b    Llama 3.2-1B: 16 x 2048, 32 heads (8 KV), vocabulary 128,256, tied, 4 x 2048
#
# Environment every script reads: OUT (results and logs; default benchmarks/results/<date>-calls),
# STEPS (steps a row; the suite halves it for offload rows), EXTRA (more suite.py arguments for every row,
# e.g. "--row-timeout 170"), VARIANTS (more rows: suite.py --variant values separated by spaces).
set -u
OUT=${OUT:-benchmarks/results/$(date +%F)-calls}
WORK=${WORK:-/tmp/dstrain-calls}
mkdir -p "$OUT" "$WORK"
EXTRA=${EXTRA:-}
VARIANTS=${VARIANTS:-}

shape_args() {
  case $1 in
    124m)  echo "--n-layer 12 --d-model 768 --n-head 12 --vocab-size 50304 --micro-batch 16" ;;
    406m)  echo "--n-layer 24 --d-model 1024 --n-head 16 --vocab-size 100352" ;;
    615m)  echo "--n-layer 20 --d-model 1536 --n-head 12 --vocab-size 32000 --seq-len 2048 --micro-batch 4" ;;
    913m)  echo "--n-layer 16 --d-model 2048 --n-head 16 --vocab-size 50304 --seq-len 2048 --micro-batch 4" ;;
    1.3b)  echo "--n-layer 24 --d-model 2048 --n-head 16 --vocab-size 50304" ;;
    1.65b) echo "--n-layer 24 --d-model 2304 --n-head 18 --vocab-size 50304" ;;
    2.65b) echo "--n-layer 32 --d-model 2560 --n-head 20 --vocab-size 50304 --seq-len 2048 --micro-batch 4" ;;
    3.78b) echo "--n-layer 32 --d-model 3072 --n-head 24 --vocab-size 50304 --seq-len 2048 --micro-batch 2" ;;
    6.6b)  echo "--n-layer 32 --d-model 4096 --n-head 32 --vocab-size 32000 --seq-len 2048 --micro-batch 2" ;;
    qwen2-1.5b|llama-1b) echo "--hf-shape $1 --seq-len 2048 --micro-batch 4" ;;
    *) echo "unknown shape '$1' (see benchmarks/calls/common.sh)" >&2; return 2 ;;
  esac
}

# DeepSpeed's JIT ops and dstrain's GIL-free Adam op, built before any row is timed so that no row's first
# step includes a compile. They build in the background beside the first (torch) row; wait_ops waits.
start_ops() {
  ( OPS="${1:-FusedAdamBuilder CPUAdamBuilder}" bash benchmarks/gpu_ops.sh
    python3 -c "from dstrain.speedups.cpu_adam_nogil import load_adam_without_gil as f; f(); print('op dstrain_cpu_adam_nogil: ready')"
  ) > "$OUT/ops.log" 2>&1 &
  OPS_PID=$!
}
wait_ops() {  # once: a later call (the next shape) only repeats the build's summary
  if [ -n "${OPS_PID:-}" ]; then wait "$OPS_PID"; OPS_PID=; fi
  grep -h "ready\|FAILED" "$OUT/ops.log"
}

# $VARIANTS as suite.py arguments, in the array VARIANT_ARGS.
variant_args() {
  VARIANT_ARGS=()
  for v in $VARIANTS; do VARIANT_ARGS+=(--variant "$v"); done
}

# One suite.py invocation: suite GPUS SHAPE OUTNAME ARGS...
suite() {
  local gpus=$1 shape=$2 name=$3; shift 3
  # shellcheck disable=SC2046
  python3 benchmarks/suite.py --work "$WORK" --gpus "$gpus" $(shape_args "$shape") --out "$OUT/$name" $EXTRA "$@"
}

# The rows' summary lines from each log, the rows' own logs in one tarball, and the machine.
summarize() {
  for log in "$@"; do
    [ -f "$log" ] || continue
    echo "== $log"
    grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)|^ *offload bound|FAILED|Error" "$log" | grep -v "  -  "
  done
  tar -czf "$OUT/rowlogs.tgz" -C "$WORK" $(cd "$WORK" && ls ./*.log 2>/dev/null) 2>/dev/null
  { nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null; nproc; } > "$OUT/machine.txt"
}
