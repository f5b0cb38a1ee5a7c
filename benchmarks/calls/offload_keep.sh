#!/bin/bash
# stage3_offload at gradient accumulation 8 on one GPU with the weights kept on the GPU between micro steps
# (speedups.offload_keep_weights, auto) and without, torch's row in the same
# call, then one profiled step of the default (issue 39, target 3). GPU_TESTS=1 first runs the GPU tests
# of the change.
#
#   bash benchmarks/calls/offload_keep.sh        # 1.65b
# Results: $OUT (see common.sh).
. "$(dirname "$0")/common.sh"
SHAPE=${SHAPE:-1.65b}
STEPS=${STEPS:-16}
A8="train.grad_accum_steps=8"
torch_row "$SHAPE"
if [ "${GPU_TESTS:-0}" = 1 ]; then
  python3 -m pytest -q -p no:cacheprovider tests/test_offload_keep_weights.py > "$OUT/gputests.log" 2>&1
  tail -3 "$OUT/gputests.log"
fi
suite 1 "$SHAPE" keep --steps "$STEPS" --row-timeout 110 --no-offload-bound --runners dstrain \
  --presets stage3_offload --no-base \
  --variant "a8@dstrain=$A8" \
  --variant "nokeep8@dstrain=$A8;speedups.offload_keep_weights=false" \
  --variant "prof8@dstrain=$A8;profile.steps=1;profile.start_after=2" > "$OUT/keep.log" 2>&1
summarize "$OUT/torch.log" "$OUT/keep.log"
