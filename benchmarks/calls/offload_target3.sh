#!/bin/bash
# Issue 39, target 3 in one call: torch's row, then stage2_offload and stage3_offload at accumulation 1 and
# 8 with the host's Adam bandwidth and PCIe rates measured and each row printed as a fraction of the bound
# they imply (benchmarks/offload_bound.py); then the GPU case of the kept-weights bit-identity tests.
#
#   bash benchmarks/calls/offload_target3.sh        # 1.65b
# Results: $OUT (see common.sh).
. "$(dirname "$0")/common.sh"
SHAPE=${SHAPE:-1.65b}
STEPS=${STEPS:-24}
torch_row "$SHAPE"
suite 1 "$SHAPE" offload --steps "$STEPS" --row-timeout 110 --runners dstrain \
  --presets stage2_offload,stage3_offload --variant "a8@dstrain=train.grad_accum_steps=8" \
  > "$OUT/offload.log" 2>&1
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_offload_keep_weights.py -k gpu \
  > "$OUT/gpu-test.log" 2>&1
tail -3 "$OUT/gpu-test.log"
summarize "$OUT/torch.log" "$OUT/offload.log"
