#!/bin/bash
# The scaling table: every preset on 1, 2 and 4 GPUs of one machine (nvidia-h100-x4 / nvidia-h200-x4), with
# torch (eager on one GPU, DDP on several) and Lightning's deepspeed_stage_* beside each, then
# benchmarks/scaling.py's table (tokens/s, scaling efficiency, fraction of torch's).
#
#   bash benchmarks/calls/scaling.sh SHAPE [PRESETS] [GPU_COUNTS]
#   bash benchmarks/calls/scaling.sh 1.65b stage1,stage2,stage3 1,2,4
#   STEPS=30 bash benchmarks/calls/scaling.sh 1.65b stage2_offload,stage3_offload 1,2,4
#
# A device command has 10 minutes: at 1.65B that is about three presets with their peers a call.
. "$(dirname "$0")/common.sh"
SHAPE=${1:?SHAPE, e.g. 1.65b}; PRESETS=${2:-stage1,stage2,stage3}; COUNTS=${3:-1,2,4}
STEPS=${STEPS:-40}
start_ops
suite "$COUNTS" "$SHAPE" "$SHAPE" --steps "$STEPS" --runners torch --presets stage2 > "$OUT/torch.log" 2>&1
wait_ops
suite "$COUNTS" "$SHAPE" "$SHAPE" --steps "$STEPS" --runners dstrain,lightning --presets "$PRESETS" > "$OUT/rows.log" 2>&1
summarize "$OUT/torch.log" "$OUT/rows.log"
python3 benchmarks/scaling.py "$OUT/$SHAPE"/*.json | tee "$OUT/scaling.txt"
