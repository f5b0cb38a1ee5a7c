#!/bin/bash
# Hugging Face shapes (issue 39, target 1): torch eager, torch with each decoder layer compiled, and dstrain
# on each preset with train.compile auto (regional compile on for hf: models on CUDA) and again eager, all on
# the same random-weight folder. On several GPUs torch is DDP through torchrun. Offload rows print their
# fraction of the host's bound (benchmarks/offload_bound.py).
#
#   bash benchmarks/calls/hf.sh GPUS SHAPE [PRESETS]
#   bash benchmarks/calls/hf.sh 1 qwen2-1.5b                        # stage2,stage3, compiled and eager
#   bash benchmarks/calls/hf.sh 2 llama-1b stage3
#   bash benchmarks/calls/hf.sh 1 qwen2-1.5b stage2_offload,stage3_offload
#
# PRESETS defaults to stage2,stage3; with an offload preset in it the eager variant is left out. STEPS (default 40; the suite halves it for offload rows). ACCUM=8 adds
# `train.grad_accum_steps=8` to the dstrain rows (the torch row steps once a micro batch: tokens/s compare).
# The folder is built on the first call (about a minute for 1.5B on a GPU, 3 GB in ~/.cache/dstrain/bench-hf).
# Results: $OUT/<shape>/*.json (see common.sh).
. "$(dirname "$0")/common.sh"
GPUS=${1:?GPUS (1, 2, 4 ...)}; SHAPE=${2:?SHAPE: qwen2-1.5b or llama-1b}
PRESETS=${3:-stage2,stage3}
STEPS=${STEPS:-40}
ACCUM=${ACCUM:-1}
start_ops
# torch beside the op build; the dstrain rows write into the same results file, whose torch row gives the
# offload rows' bound its GPU part. The eager variant only where auto compiles (not the offload presets).
EAGER=(--variant "eager@dstrain=train.compile=false")
case $PRESETS in *offload*) EAGER=() ;; esac
suite "$GPUS" "$SHAPE" "$SHAPE" --steps "$STEPS" --runners torch --presets stage2 \
  --variant "compiled@torch=+compile_blocks" > "$OUT/torch-$SHAPE.log" 2>&1
wait_ops
suite "$GPUS" "$SHAPE" "$SHAPE" --steps "$STEPS" --runners dstrain --presets "$PRESETS" \
  --set "train.grad_accum_steps=$ACCUM" ${EAGER[@]+"${EAGER[@]}"} > "$OUT/dstrain-$SHAPE.log" 2>&1
summarize "$OUT"/torch-*.log "$OUT"/dstrain-*.log
