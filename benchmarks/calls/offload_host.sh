#!/bin/bash
# Where the host's time goes in stage3_offload at gradient accumulation 8 on one GPU: one step profiled with
# Python stacks, summarised by benchmarks/trace_host.py (issue 39, target 3). VARIANT adds settings.
#
#   bash benchmarks/calls/offload_host.sh        # 1.65b
# Results: $OUT (see common.sh): host.txt, the row's JSON and log.
. "$(dirname "$0")/common.sh"
SHAPE=${SHAPE:-1.65b}
start_ops
wait_ops
suite 1 "$SHAPE" host --steps 8 --row-timeout 150 --keep-runs --no-offload-bound --runners dstrain --presets stage3_offload \
  --no-base --variant "stack8@dstrain=train.grad_accum_steps=8;profile.steps=1;profile.start_after=2;profile.with_stack=true${VARIANT:+;$VARIANT}" \
  > "$OUT/host.log" 2>&1
python3 benchmarks/trace_host.py "$WORK"/dstrain-stage3_offload-1g-stack8/profile/rank0.trace.json.gz --top 45 \
  > "$OUT/host.txt" 2>&1
python3 benchmarks/trace_host.py "$WORK"/dstrain-stage3_offload-1g-stack8/profile/rank0.trace.json.gz --top 40 \
  --match deepspeed/ > "$OUT/host-deepspeed.txt" 2>&1
summarize "$OUT/host.log"
