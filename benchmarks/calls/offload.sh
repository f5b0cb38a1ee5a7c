#!/bin/bash
# The offload presets at gradient accumulation 1 and ACCUM, against torch both ways a torch user runs it: a
# step a batch, and accumulating ACCUM micro batches a step (DDP's no_sync on several GPUs). Every offload
# row prints its fraction of the bound that the host's Adam bandwidth, the PCIe rates and torch's row at the
# same accumulation imply (benchmarks/offload_bound.py). docs/benchmarks.md, "Offload with gradient
# accumulation".
#
#   bash benchmarks/calls/offload.sh GPUS SHAPE [PRESETS]
#   bash benchmarks/calls/offload.sh 1 1.65b                            # the table's calls E and F
#   NOKEEP=1 bash benchmarks/calls/offload.sh 1 1.65b stage3_offload    # rows A and C: weights kept and not
#   NOKEEP=1 bash benchmarks/calls/offload.sh 2 1.65b stage3_offload    # the same beside DDP on two GPUs
#   VARIANTS='prof8@dstrain=train.grad_accum_steps=8;profile.steps=1;profile.start_after=2' \
#     bash benchmarks/calls/offload.sh 1 1.65b stage3_offload           # one step profiled (docs/runs.md)
#
# PRESETS defaults to stage2_offload,stage3_offload, ACCUM to 8, STEPS to 24 (the suite halves it for
# offload rows). NOKEEP=1 adds rows at ACCUM with speedups.offload_keep_weights=false. Results:
# $OUT/<shape>/ (one file: the bound reads torch's rows from it), logs $OUT/*.log (see common.sh).
. "$(dirname "$0")/common.sh"
GPUS=${1:?GPUS}; SHAPE=${2:?SHAPE, e.g. 1.65b}; PRESETS=${3:-stage2_offload,stage3_offload}
ACCUM=${ACCUM:-8}; STEPS=${STEPS:-24}
A="train.grad_accum_steps=$ACCUM"
ROWS=()
[ "$ACCUM" != 1 ] && ROWS+=(--variant "a$ACCUM@torch,dstrain=$A")
[ "${NOKEEP:-0}" = 1 ] && ROWS+=(--variant "nokeep$ACCUM@dstrain=$A;speedups.offload_keep_weights=false")
variant_args
start_ops
# torch beside the op build: a step a batch, then accumulating (the same variant name pairs it with
# dstrain's rows; the suite gives torch only the variants that name it).
suite "$GPUS" "$SHAPE" "$SHAPE" --steps 32 --runners torch --presets stage2 ${ROWS[@]+"${ROWS[@]}"} \
  > "$OUT/torch.log" 2>&1
wait_ops
suite "$GPUS" "$SHAPE" "$SHAPE" --steps "$STEPS" --row-timeout 130 --runners dstrain --presets "$PRESETS" \
  ${ROWS[@]+"${ROWS[@]}"} ${VARIANT_ARGS[@]+"${VARIANT_ARGS[@]}"} > "$OUT/offload.log" 2>&1
summarize "$OUT/torch.log" "$OUT/offload.log"
