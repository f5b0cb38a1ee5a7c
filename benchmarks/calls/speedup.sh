#!/bin/bash
# What one speed-up is worth: dstrain's rows with it and without it, alternating in pairs on one machine
# (host-bound rows swing 10-40% between intervals, so only repeated pairs count), and torch first. The
# "measured gain" of each section of docs/performance.md.
#
#   bash benchmarks/calls/speedup.sh GPUS SHAPE PRESET OFF [PAIRS]
#   bash benchmarks/calls/speedup.sh 1 406m stage3 speedups.zero3_grads=false
#   bash benchmarks/calls/speedup.sh 2 406m stage3 speedups.zero3_gather=false 3
#   bash benchmarks/calls/speedup.sh 1 1.3b stage3_offload +env:DSTRAIN_OFFLOAD_OVERLAP=off
#
# OFF is a dstrain override (key=value) or a suite flag (+env:NAME=VALUE for the DSTRAIN_* variable),
# several joined by ";". PAIRS defaults to 3, STEPS to 60. Results: $OUT/<shape>/*.json (see common.sh).
. "$(dirname "$0")/common.sh"
GPUS=${1:?GPUS}; SHAPE=${2:?SHAPE}; PRESET=${3:?PRESET}; OFF=${4:?OFF, e.g. speedups.zero3_grads=false}
PAIRS=${5:-3}; STEPS=${STEPS:-60}
VARIANTS=()
for i in $(seq "$PAIRS"); do VARIANTS+=(--variant "on$i@dstrain=" --variant "off$i@dstrain=$OFF"); done
start_ops
suite "$GPUS" "$SHAPE" "$SHAPE" --steps "$STEPS" --runners torch --presets stage2 > "$OUT/torch.log" 2>&1
wait_ops
suite "$GPUS" "$SHAPE" "$SHAPE" --steps "$STEPS" --runners dstrain --presets "$PRESET" --no-base "${VARIANTS[@]}" \
  > "$OUT/pairs.log" 2>&1
summarize "$OUT/torch.log" "$OUT/pairs.log"
