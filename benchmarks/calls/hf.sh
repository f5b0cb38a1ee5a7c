#!/bin/bash
# Hugging Face shapes on a random-weight folder: torch eager and torch with each decoder layer compiled
# (DDP through torchrun on several GPUs), then dstrain on each preset with its defaults (train.compile auto:
# each layer compiled on CUDA; at ZeRO-3 the layers kept whole) and again eager.
#
#   bash benchmarks/calls/hf.sh GPUS SHAPES [PRESETS]
#   bash benchmarks/calls/hf.sh 1 qwen2-1.5b stage2                          # "Hugging Face models, one GPU"
#   SHARDED=1 EAGER=0 bash benchmarks/calls/hf.sh 1 qwen2-1.5b,llama-1b stage3  # layers whole against sharded
#   bash benchmarks/calls/hf.sh 4 qwen2-1.5b stage3
#   ACCUM=8 bash benchmarks/calls/hf.sh 1 qwen2-1.5b stage2_offload,stage3_offload
#
# PRESETS defaults to stage2,stage3. EAGER=0 leaves out the eager dstrain rows (offload presets always do:
# auto does not compile there). SHARDED=1 adds stage3 rows with the layers sharded as DeepSpeed's preset
# has them (persistence threshold 100,000). ACCUM adds train.grad_accum_steps to the dstrain rows (torch
# steps every micro batch). Offload rows print their fraction of the host's bound. STEPS defaults to 40.
# The folder is built on the first call (about a minute at 1.5B, 3 GB in ~/.cache/dstrain/bench-hf).
# Results: $OUT/<shape>/*.json (see common.sh).
. "$(dirname "$0")/common.sh"
GPUS=${1:?GPUS}; SHAPES=${2:?SHAPES: qwen2-1.5b and/or llama-1b}; PRESETS=${3:-stage2,stage3}
STEPS=${STEPS:-40}; ACCUM=${ACCUM:-1}
ROWS=()
case $PRESETS in *offload*) EAGER=0 ;; esac
[ "${EAGER:-1}" = 1 ] && ROWS+=(--variant "eager@dstrain=train.compile=false")
[ "${SHARDED:-0}" = 1 ] && \
  ROWS+=(--variant "sharded@dstrain=deepspeed.zero_optimization.stage3_param_persistence_threshold=100000")
variant_args
start_ops
for shape in ${SHAPES//,/ }; do
  # torch beside the op build; the dstrain rows write into the same results file, whose torch row gives
  # the offload rows' bound its GPU part.
  suite "$GPUS" "$shape" "$shape" --steps "$STEPS" --runners torch --presets stage2 \
    --variant "compiled@torch=+compile_blocks" > "$OUT/torch-$shape.log" 2>&1
  wait_ops
  suite "$GPUS" "$shape" "$shape" --steps "$STEPS" --runners dstrain --presets "$PRESETS" \
    --set "train.grad_accum_steps=$ACCUM" ${ROWS[@]+"${ROWS[@]}"} ${VARIANT_ARGS[@]+"${VARIANT_ARGS[@]}"} \
    > "$OUT/dstrain-$shape.log" 2>&1
done
summarize "$OUT"/torch-*.log "$OUT"/dstrain-*.log
