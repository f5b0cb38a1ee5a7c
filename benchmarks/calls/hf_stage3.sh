#!/bin/bash
# Hugging Face shapes at ZeRO-3 (issue 39, target 1): torch (eager on one GPU, DDP on several) against
# dstrain stage3 with its defaults (each decoder layer a leaf module kept whole on every rank, and compiled
# on CUDA) and with the layers sharded as DeepSpeed's preset has them (persistence threshold 100,000; `auto`
# leaves those eager), same folder, same call. EAGER=1 adds a row with the layers whole and eager
# (train.compile=false).
#
#   bash benchmarks/calls/hf_stage3.sh GPUS SHAPES
#   bash benchmarks/calls/hf_stage3.sh 1 qwen2-1.5b,llama-1b
#   bash benchmarks/calls/hf_stage3.sh 1,2 qwen2-1.5b
#
# STEPS (default 40). Results: $OUT/<shape>/*.json (see common.sh).
. "$(dirname "$0")/common.sh"
GPUS=${1:?GPUS (1, 2 or 1,2)}; SHAPES=${2:-qwen2-1.5b,llama-1b}
STEPS=${STEPS:-40}
start_ops
for shape in ${SHAPES//,/ }; do
  suite "$GPUS" "$shape" "$shape" --steps "$STEPS" --runners torch --presets stage2 > "$OUT/torch-$shape.log" 2>&1
  [ -n "${OPS_PID:-}" ] && { wait_ops; OPS_PID=; }
  COMPILE=()
  [ "${EAGER:-0}" = 1 ] && COMPILE=(--variant "eager@dstrain=train.compile=false")
  suite "$GPUS" "$shape" "$shape" --steps "$STEPS" --runners dstrain --presets stage3 \
    --variant "sharded@dstrain=deepspeed.zero_optimization.stage3_param_persistence_threshold=100000" \
    ${COMPILE[@]+"${COMPILE[@]}"} > "$OUT/dstrain-$shape.log" 2>&1
done
summarize "$OUT"/torch-*.log "$OUT"/dstrain-*.log
