#!/bin/bash
# The GPU calls behind docs/benchmarks.md's tables ("How to reproduce" names the call of each). Each call
# builds DeepSpeed's ops beside its first row (no row times a compile), runs plain torch first, then the
# mode's rows through benchmarks/suite.py in the same results file, and prints the rows' summary lines.
# From the repository root on the GPU machine, after `source benchmarks/gpu_env.sh`:
#
#   bash benchmarks/calls.sh peers GPUS SHAPES [PRESETS]    dstrain beside torch, the hand loop and Lightning
#   bash benchmarks/calls.sh offload GPUS SHAPE [PRESETS]   offload presets at accumulation 1 and ACCUM, torch both ways
#   bash benchmarks/calls.sh hf GPUS SHAPES [PRESETS]       HF shapes: torch eager and compiled, dstrain compiled and eager
#   bash benchmarks/calls.sh speedup GPUS SHAPE PRESET OFF [PAIRS]   dstrain with and without one setting, in pairs
#
# GPUS is a count or a list (1,2,4: peers then prints benchmarks/scaling.py's table); SHAPES one or more of
# shape_args' names below. Environment: OUT (results and logs; default benchmarks/results/<date>-calls), STEPS
# (steps a row; the suite halves it for offload rows), EXTRA (more suite.py arguments for every row; a later
# --n-layer and the like override the shape), VARIANTS (more rows: suite.py --variant values, space-separated),
# RUNNERS (peers; default dstrain,deepspeed,lightning: with the hand loop, dstrain's rows run again last so the
# machine's drift shows), ACCUM (offload, default 8; hf, default 1: train.grad_accum_steps), NOKEEP=1 (offload:
# rows with speedups.offload_keep_weights=false), SHARDED=1 (hf: stage3 with the layers sharded), EAGER=0 (hf:
# no eager dstrain rows; offload presets never have them), OFF (speedup: a dstrain override key=value or
# +env:NAME=VALUE, several joined by ";"). One device command lasts 10 minutes: give a 1.3B shape a call of its
# own, or split the presets. Results: $OUT/<shape>/*.json, logs $OUT/*.log, the rows' own logs $OUT/rowlogs.tgz.
set -u
MODE=${1:?MODE: peers, offload, hf or speedup}; shift
OUT=${OUT:-benchmarks/results/$(date +%F)-calls}
WORK=${WORK:-/tmp/dstrain-calls}
mkdir -p "$OUT" "$WORK"
EXTRA=${EXTRA:-}
ROWS=()
for v in ${VARIANTS:-}; do ROWS+=(--variant "$v"); done

shape_args() {  # dstrain's built-in GPT (layers, width, heads, vocabulary, micro batch x sequence) or an HF shape
  case $1 in
    124m)  echo "--n-layer 12 --d-model 768 --n-head 12 --vocab-size 50304 --micro-batch 16" ;;
    406m)  echo "--n-layer 24 --d-model 1024 --n-head 16 --vocab-size 100352" ;;  # 8 x 1024, the suite's default
    615m)  echo "--n-layer 20 --d-model 1536 --n-head 12 --vocab-size 32000 --seq-len 2048 --micro-batch 4" ;;
    913m)  echo "--n-layer 16 --d-model 2048 --n-head 16 --vocab-size 50304 --seq-len 2048 --micro-batch 4" ;;
    1.3b)  echo "--n-layer 24 --d-model 2048 --n-head 16 --vocab-size 50304" ;;
    1.65b) echo "--n-layer 24 --d-model 2304 --n-head 18 --vocab-size 50304" ;;
    2.65b) echo "--n-layer 32 --d-model 2560 --n-head 20 --vocab-size 50304 --seq-len 2048 --micro-batch 4" ;;
    3.78b) echo "--n-layer 32 --d-model 3072 --n-head 24 --vocab-size 50304 --seq-len 2048 --micro-batch 2" ;;
    6.6b)  echo "--n-layer 32 --d-model 4096 --n-head 32 --vocab-size 32000 --seq-len 2048 --micro-batch 2" ;;
    qwen2-1.5b|llama-1b) echo "--hf-shape $1 --seq-len 2048 --micro-batch 4" ;;  # random weights, built once
    *) echo "unknown shape '$1' (see shape_args in benchmarks/calls.sh)" >&2; exit 2 ;;
  esac
}

suite() {  # suite GPUS SHAPE LOG ARGS...: one suite.py invocation into $OUT/SHAPE/, its output in $OUT/LOG.log
  local gpus=$1 shape=$2 log=$3; shift 3
  # shellcheck disable=SC2046
  python3 benchmarks/suite.py --work "$WORK" --gpus "$gpus" $(shape_args "$shape") --out "$OUT/$shape" $EXTRA "$@" \
    > "$OUT/$log.log" 2>&1
}

pairs() {  # pairs N NAME_ON SETS_ON NAME_OFF SETS_OFF: alternating variants (host-bound rows need repeated pairs)
  for i in $(seq "$1"); do ROWS+=(--variant "$2$i$3" --variant "$4$i$5"); done
}

TORCH=(--steps "${STEPS:-40}")  # the torch row(s), beside the op build; an empty list: none
AGAIN=0
case $MODE in
  peers)
    GPUS=${1:?GPUS}; SHAPES=${2:?SHAPES}; RUNNERS=${RUNNERS:-dstrain,deepspeed,lightning}
    PRESETS=${3:-stage1,stage2,stage3,stage2_offload,stage3_offload}
    [ "$GPUS" != 1 ] && PRESETS=${3:-stage1,stage2,stage3}
    case $RUNNERS in *deepspeed*) AGAIN=1 ;; esac
    ROWS+=(--steps "${STEPS:-40}" --runners "$RUNNERS" --presets "$PRESETS") ;;
  offload)
    GPUS=${1:?GPUS}; SHAPES=${2:?SHAPE}; ACCUM=${ACCUM:-8}; A="train.grad_accum_steps=$ACCUM"
    ACCUMULATED=()  # the same variant name pairs torch accumulating with dstrain's rows (the offload bound)
    [ "$ACCUM" != 1 ] && ACCUMULATED+=(--variant "a$ACCUM@torch,dstrain=$A")
    [ "${NOKEEP:-0}" = 1 ] && ACCUMULATED+=(--variant "nokeep$ACCUM@dstrain=$A;speedups.offload_keep_weights=false")
    TORCH=(--steps 32 ${ACCUMULATED[@]+"${ACCUMULATED[@]}"})
    ROWS+=(--steps "${STEPS:-24}" --row-timeout 130 --runners dstrain --presets "${3:-stage2_offload,stage3_offload}"
           ${ACCUMULATED[@]+"${ACCUMULATED[@]}"}) ;;
  hf)
    GPUS=${1:?GPUS}; SHAPES=${2:?SHAPES: qwen2-1.5b and/or llama-1b}; PRESETS=${3:-stage2,stage3}
    TORCH+=(--variant "compiled@torch=+compile_blocks")
    case $PRESETS in *offload*) EAGER=0 ;; esac  # auto compiles nothing there
    [ "${EAGER:-1}" = 1 ] && ROWS+=(--variant "eager@dstrain=train.compile=false")
    [ "${SHARDED:-0}" = 1 ] && \
      ROWS+=(--variant "sharded@dstrain=deepspeed.zero_optimization.stage3_param_persistence_threshold=100000")
    ROWS+=(--steps "${STEPS:-40}" --runners dstrain --presets "$PRESETS" --set "train.grad_accum_steps=${ACCUM:-1}") ;;
  speedup)
    GPUS=${1:?GPUS}; SHAPES=${2:?SHAPE}; OFF=${4:?OFF, e.g. speedups.zero3_grads=false}
    TORCH=(--steps "${STEPS:-60}")
    pairs "${5:-3}" on "@dstrain=" off "@dstrain=$OFF"
    ROWS+=(--steps "${STEPS:-60}" --runners dstrain --presets "${3:?PRESET}" --no-base) ;;
  *) echo "unknown mode '$MODE': peers, offload, hf or speedup" >&2; exit 2 ;;
esac

( OPS=${OPS:-FusedAdamBuilder CPUAdamBuilder} bash benchmarks/gpu_ops.sh
  python3 -c "from dstrain.speedups.cpu_adam_nogil import load_adam_without_gil as f; f(); print('op dstrain_cpu_adam_nogil: ready')"
) > "$OUT/ops.log" 2>&1 &
OPS_PID=$!
for shape in ${SHAPES//,/ }; do
  [ ${#TORCH[@]} -gt 0 ] && suite "$GPUS" "$shape" "torch-$shape" --runners torch --presets stage2 "${TORCH[@]}"
  if [ -n "$OPS_PID" ]; then wait "$OPS_PID"; OPS_PID=; grep -h "ready\|FAILED" "$OUT/ops.log"; fi
  suite "$GPUS" "$shape" "rows-$shape" "${ROWS[@]}"
  [ "$AGAIN" = 1 ] && suite "$GPUS" "$shape" "again-$shape" --steps "${STEPS:-40}" --runners dstrain \
    --presets "$PRESETS" --no-base --variant "again@dstrain="
  case $GPUS in *,*) python3 benchmarks/scaling.py "$OUT/$shape"/*.json | tee "$OUT/scaling-$shape.txt" ;; esac
done

for log in "$OUT"/torch-*.log "$OUT"/rows-*.log "$OUT"/again-*.log; do  # the rows' summary lines
  [ -f "$log" ] || continue
  echo "== $log"
  grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)|^ *offload bound|FAILED|Error" "$log" | grep -v "  -  "
done
tar -czf "$OUT/rowlogs.tgz" -C "$WORK" $(cd "$WORK" && ls ./*.log 2>/dev/null) 2>/dev/null
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null; nproc; } > "$OUT/machine.txt"
