#!/bin/bash
# dstrain beside the alternatives a user has, in one call on one machine: torch (eager; DDP on several GPUs),
# dstrain, the hand loop (DeepSpeed driven as its documentation writes it, given the JSON dstrain renders)
# and PyTorch Lightning's deepspeed_stage_* strategy for the preset (none for NVMe). dstrain's row runs
# again last, so a drift of the machine shows. The "hand loop" and "Lightning" columns of docs/benchmarks.md.
#
#   bash benchmarks/calls/peers.sh GPUS SHAPE [PRESETS]
#   bash benchmarks/calls/peers.sh 1 406m stage3
#   bash benchmarks/calls/peers.sh 2 1.3b stage1,stage2,stage3
#
# PRESETS defaults to stage1,stage2,stage3. STEPS (default 40) sets the rows' length. Results:
# $OUT/<shape>/*.json (see common.sh). Lightning must be installed (the suite says so where it is not).
. "$(dirname "$0")/common.sh"
GPUS=${1:?GPUS (1, 2, 4 ...)}; SHAPE=${2:?SHAPE, e.g. 406m}; PRESETS=${3:-stage1,stage2,stage3}
STEPS=${STEPS:-40}
start_ops
suite "$GPUS" "$SHAPE" "$SHAPE" --steps "$STEPS" --runners torch --presets stage2 > "$OUT/torch.log" 2>&1
wait_ops
suite "$GPUS" "$SHAPE" "$SHAPE" --steps "$STEPS" --runners dstrain,deepspeed,lightning --presets "$PRESETS" \
  > "$OUT/peers.log" 2>&1
suite "$GPUS" "$SHAPE" "$SHAPE" --steps "$STEPS" --runners dstrain --presets "$PRESETS" --no-base \
  --variant "again@dstrain=" > "$OUT/again.log" 2>&1
summarize "$OUT/torch.log" "$OUT/peers.log" "$OUT/again.log"
