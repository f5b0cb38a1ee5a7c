#!/bin/bash
# Issue 39, target 3 in one call: torch's rows (a step a batch, and accumulating 8 micro batches a step),
# then stage2_offload and stage3_offload at accumulation 1 and 8, each printed as a fraction of the bound
# that the host's Adam bandwidth, the PCIe rates and torch's row at the same accumulation imply
# (benchmarks/offload_bound.py); then the GPU case of the kept-weights bit-identity tests.
#
#   bash benchmarks/calls/offload_target3.sh        # 1.65b
# Results: $OUT/target3/ (one file: the bound reads torch's rows from it), logs $OUT/*.log.
. "$(dirname "$0")/common.sh"
SHAPE=${SHAPE:-1.65b}
STEPS=${STEPS:-24}
A8="train.grad_accum_steps=8"
start_ops
suite 1 "$SHAPE" target3 --steps 32 --runners torch --presets stage2 --variant "a8@torch=$A8" > "$OUT/torch.log" 2>&1
wait_ops
suite 1 "$SHAPE" target3 --steps "$STEPS" --row-timeout 110 --runners dstrain \
  --presets stage2_offload,stage3_offload --variant "a8@dstrain=$A8" > "$OUT/offload.log" 2>&1
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_offload_keep_weights.py -k gpu \
  > "$OUT/gpu-test.log" 2>&1
tail -3 "$OUT/gpu-test.log"
summarize "$OUT/torch.log" "$OUT/offload.log"
