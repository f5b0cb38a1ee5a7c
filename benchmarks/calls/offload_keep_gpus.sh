#!/bin/bash
# Issue 39, target 3 on several GPUs: stage3_offload at accumulation 8 with the weights kept through the
# window (the default) and without (speedups.offload_keep_weights=false), beside DDP's row on as many GPUs.
#
#   GPUS=2 bash benchmarks/calls/offload_keep_gpus.sh        # 1.65b
# Results: $OUT (see common.sh).
. "$(dirname "$0")/common.sh"
SHAPE=${SHAPE:-1.65b}
GPUS=${GPUS:-2}
STEPS=${STEPS:-16}
A8="train.grad_accum_steps=8"
start_ops
suite "$GPUS" "$SHAPE" ddp --steps 40 --runners torch --presets stage2 > "$OUT/ddp.log" 2>&1
wait_ops
suite "$GPUS" "$SHAPE" offload --steps "$STEPS" --row-timeout 130 --no-offload-bound --runners dstrain \
  --presets stage3_offload --no-base \
  --variant "a8@dstrain=$A8" --variant "nokeep8@dstrain=$A8;speedups.offload_keep_weights=false" \
  > "$OUT/offload.log" 2>&1
summarize "$OUT/ddp.log" "$OUT/offload.log"
