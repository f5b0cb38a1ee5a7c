#!/bin/bash
# dstrain against plain PyTorch: torch (eager; DDP through torchrun on several GPUs) and dstrain on each
# preset, every shape named. The "dstrain" and "of torch" columns of docs/benchmarks.md's tables.
#
#   bash benchmarks/calls/matrix.sh GPUS SHAPES [PRESETS]
#   bash benchmarks/calls/matrix.sh 1 406m,1.3b                      # one GPU, the five presets without NVMe
#   bash benchmarks/calls/matrix.sh 2 406m stage1,stage2,stage3      # two GPUs
#
# PRESETS defaults to stage1,stage2,stage3,stage2_offload,stage3_offload on one GPU and stage1,stage2,stage3
# on several. STEPS (default 60; the suite halves it for offload rows) sets the rows' length. A device
# command has 10 minutes: at 1.3B, give one shape per call. Results: $OUT/<shape>/*.json (see common.sh).
. "$(dirname "$0")/common.sh"
GPUS=${1:?GPUS (1, 2, 4 ...)}; SHAPES=${2:?SHAPES, e.g. 406m,1.3b}
DEFAULT=stage1,stage2,stage3,stage2_offload,stage3_offload
[ "$GPUS" -gt 1 ] && DEFAULT=stage1,stage2,stage3
PRESETS=${3:-$DEFAULT}
STEPS=${STEPS:-60}
start_ops
first=1
for shape in ${SHAPES//,/ }; do
  suite "$GPUS" "$shape" "$shape" --steps "$STEPS" --runners torch --presets stage2 > "$OUT/torch-$shape.log" 2>&1
  [ "$first" = 1 ] && wait_ops && first=0
  suite "$GPUS" "$shape" "$shape" --steps "$STEPS" --runners dstrain --presets "$PRESETS" > "$OUT/dstrain-$shape.log" 2>&1
done
summarize "$OUT"/torch-*.log "$OUT"/dstrain-*.log
