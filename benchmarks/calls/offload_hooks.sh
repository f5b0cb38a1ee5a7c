#!/bin/bash
# Issue 39, target 3 at accumulation 8 on one GPU: DeepSpeed's module hooks skipped after a window's first
# micro step (speedups.offload_window_hooks, the default) against them running at every micro step, in
# alternating stage3_offload rows beside torch's row; then the GPU case of the bit-identity tests.
#
#   bash benchmarks/calls/offload_hooks.sh        # 1.65b
# Results: $OUT (see common.sh).
. "$(dirname "$0")/common.sh"
SHAPE=${SHAPE:-1.65b}
STEPS=${STEPS:-16}
A8="train.grad_accum_steps=8"
torch_row "$SHAPE"
suite 1 "$SHAPE" offload --steps "$STEPS" --row-timeout 110 --no-offload-bound --runners dstrain \
  --presets stage3_offload --no-base \
  --variant "a8@dstrain=$A8" --variant "hooks8@dstrain=$A8;speedups.offload_window_hooks=false" \
  --variant "a8b@dstrain=$A8" --variant "hooks8b@dstrain=$A8;speedups.offload_window_hooks=false" \
  > "$OUT/offload.log" 2>&1
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_offload_keep_weights.py -k gpu \
  > "$OUT/gpu-test.log" 2>&1
tail -3 "$OUT/gpu-test.log"
summarize "$OUT/torch.log" "$OUT/offload.log"
