#!/bin/bash
# The CPU-offload presets on one GPU: torch, then dstrain, the hand loop and Lightning on stage2_offload and
# stage3_offload, then dstrain's rows again. Their speed follows the host (its memory bandwidth runs the
# Adam step), so compare rows of one call only. The offload table of docs/benchmarks.md.
#
#   bash benchmarks/calls/offload.sh SHAPES
#   bash benchmarks/calls/offload.sh 406m
#   bash benchmarks/calls/offload.sh 913m,1.3b
#
# STEPS (default 40 for offload rows; the torch row runs 60) sets the rows' length. Results:
# $OUT/<shape>/*.json (see common.sh).
. "$(dirname "$0")/common.sh"
SHAPES=${1:?SHAPES, e.g. 406m or 913m,1.3b}
STEPS=${STEPS:-40}
OFFLOAD=stage2_offload,stage3_offload
start_ops
first=1
for shape in ${SHAPES//,/ }; do
  suite 1 "$shape" "$shape" --steps 60 --runners torch --presets stage2 > "$OUT/torch-$shape.log" 2>&1
  [ "$first" = 1 ] && wait_ops && first=0
  suite 1 "$shape" "$shape" --steps "$STEPS" --runners dstrain,deepspeed,lightning --presets "$OFFLOAD" \
    > "$OUT/peers-$shape.log" 2>&1
  suite 1 "$shape" "$shape" --steps "$STEPS" --runners dstrain --presets "$OFFLOAD" --no-base \
    --variant "again@dstrain=" > "$OUT/again-$shape.log" 2>&1
done
summarize "$OUT"/torch-*.log "$OUT"/peers-*.log "$OUT"/again-*.log
