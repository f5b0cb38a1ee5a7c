#!/bin/bash
# stage3_offload at gradient accumulation 8 on one GPU: the preset's fetch settings against wider ones,
# to find whether DeepSpeed's prefetcher is starved (issue 39, target 3). torch's row runs beside the op
# build; then the dstrain rows; then one profiled step of the variant in PROFILE (default live1e9).
#
#   bash benchmarks/calls/offload_prefetch.sh        # 1.65b
# Results: $OUT (see common.sh).
. "$(dirname "$0")/common.sh"
SHAPE=${SHAPE:-1.65b}
STEPS=${STEPS:-16}
A8="train.grad_accum_steps=8"
Z="deepspeed.zero_optimization"
torch_row "$SHAPE"
suite 1 "$SHAPE" prefetch --steps "$STEPS" --row-timeout 110 --no-offload-bound --runners dstrain \
  --presets stage3_offload --no-base \
  --variant "a8@dstrain=$A8" \
  --variant "live1e9@dstrain=$A8;$Z.stage3_max_live_parameters=1000000000" \
  --variant "live1e9pf2e8@dstrain=$A8;$Z.stage3_max_live_parameters=1000000000;$Z.stage3_prefetch_bucket_size=200000000" \
  --variant "reuse0@dstrain=$A8;$Z.stage3_max_reuse_distance=0;$Z.stage3_prefetch_bucket_size=200000000" \
  ${PROFILE_VARIANT:+--variant "$PROFILE_VARIANT"} > "$OUT/prefetch.log" 2>&1
summarize "$OUT/torch.log" "$OUT/prefetch.log"
