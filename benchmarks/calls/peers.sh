#!/bin/bash
# dstrain beside what a user would run instead, in one call on one machine: torch (eager; DDP through
# torchrun on several GPUs) first, then the RUNNERS on each preset: dstrain, the hand loop (DeepSpeed driven
# as its documentation writes it, given the JSON dstrain renders) and PyTorch Lightning's deepspeed_stage_*
# strategy. With the hand loop among them dstrain's rows run again last, so a drift of the machine shows.
#
#   bash benchmarks/calls/peers.sh GPUS SHAPES [PRESETS]
#   RUNNERS=dstrain STEPS=60 bash benchmarks/calls/peers.sh 1 406m          # "of torch" alone, five presets
#   bash benchmarks/calls/peers.sh 2 1.3b stage1,stage2,stage3             # with the hand loop and Lightning
#   bash benchmarks/calls/peers.sh 1 406m stage2_offload,stage3_offload    # the offload presets' peers
#   RUNNERS=dstrain,lightning bash benchmarks/calls/peers.sh 1,2,4 1.65b   # scaling: prints scaling.py's table
#
# GPUS is a count or a list of counts. PRESETS defaults to every preset but NVMe on one GPU, stage1,stage2,
# stage3 on several. RUNNERS defaults to dstrain,deepspeed,lightning; STEPS to 40. A device command has 10
# minutes: give a 1.3B shape a call of its own. Results: $OUT/<shape>/*.json (see common.sh).
. "$(dirname "$0")/common.sh"
GPUS=${1:?GPUS, e.g. 1, 2 or 1,2,4}; SHAPES=${2:?SHAPES, e.g. 406m or 913m,1.3b}
DEFAULT=stage1,stage2,stage3,stage2_offload,stage3_offload
[ "$GPUS" != 1 ] && DEFAULT=stage1,stage2,stage3
PRESETS=${3:-$DEFAULT}
RUNNERS=${RUNNERS:-dstrain,deepspeed,lightning}
STEPS=${STEPS:-40}
AGAIN=0
case $RUNNERS in *deepspeed*) AGAIN=1 ;; esac
variant_args
start_ops
for shape in ${SHAPES//,/ }; do
  suite "$GPUS" "$shape" "$shape" --steps "$STEPS" --runners torch --presets stage2 > "$OUT/torch-$shape.log" 2>&1
  wait_ops
  suite "$GPUS" "$shape" "$shape" --steps "$STEPS" --runners "$RUNNERS" --presets "$PRESETS" \
    ${VARIANT_ARGS[@]+"${VARIANT_ARGS[@]}"} > "$OUT/rows-$shape.log" 2>&1
  if [ "$AGAIN" = 1 ]; then
    suite "$GPUS" "$shape" "$shape" --steps "$STEPS" --runners dstrain --presets "$PRESETS" --no-base \
      --variant "again@dstrain=" > "$OUT/again-$shape.log" 2>&1
  fi
  # Several GPU counts: the scaling table (efficiency against N times the one-GPU row).
  case $GPUS in *,*) python3 benchmarks/scaling.py "$OUT/$shape"/*.json | tee "$OUT/scaling-$shape.txt" ;; esac
done
summarize "$OUT"/torch-*.log "$OUT"/rows-*.log "$OUT"/again-*.log
