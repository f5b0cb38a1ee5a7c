#!/bin/bash
# Prepared in session 11 (no device time then), for the next two-GPU lease (nvidia-h100-x2 held warm
# between two calls), after `source benchmarks/gpu_env.sh`, carry [".whl"]. Run these before
# 2026-11-25-h100x2-matrix.sh: they decide dstrain's own two-GPU ZeRO-3 defaults, the matrix adds peers.
#   PART=406  the two-GPU test of dstrain's ZeRO-3 step on NCCL (tests/test_zero3_step.py), then 406M
#             stage3 with the gather of finding 43 against DSTRAIN_ZERO3_GATHER=off, alternating, and DDP
#   PART=13   1.3B stage3 as dstrain renders it (blocks partitioned over 1B parameters) against blocks
#             kept whole (the persistence dstrain uses under 1B, set by hand), alternating, and DDP
# At most five files come back: tests.log, ops.log, rows.log, the suite's JSON, rowlogs.tgz.
set -u
W=/tmp/wx2g; mkdir -p $W $OUT/r
OPS="FusedAdamBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1 &
OPSPID=$!
if [ "${PART:-406}" = 13 ]; then
  S="python3 benchmarks/suite.py --work $W --gpus 2 --steps 30 --row-timeout 150 --out $OUT/r
     --n-layer 24 --d-model 2048 --n-head 16 --vocab-size 50304"
  # 4 x 2048^2: a block's largest weight, as speed_defaults.py sets it under 1B parameters
  V="whole@dstrain=deepspeed.zero_optimization.stage3_param_persistence_threshold=16777216"
  V="$V;deepspeed.zero_optimization.memory_efficient_linear=false"
  { $S --runners torch --presets stage3
    wait $OPSPID
    $S --runners dstrain --presets stage3 --variant "$V"
    $S --runners dstrain --presets stage3 --no-base --variant "again@dstrain=" --variant "${V/whole@/whole_again@}"
  } > $OUT/rows.log 2>&1
else
  python3 -m pytest -q -p no:cacheprovider tests/test_zero3_step.py -k two_ranks > $OUT/tests.log 2>&1
  S="python3 benchmarks/suite.py --work $W --gpus 2 --steps 60 --row-timeout 120 --out $OUT/r"
  OFF="gather_off@dstrain=+env:DSTRAIN_ZERO3_GATHER=off"
  { $S --runners torch --presets stage3
    wait $OPSPID
    $S --runners dstrain --presets stage3 --variant "$OFF"
    $S --runners dstrain --presets stage3 --no-base --variant "again@dstrain=" --variant "${OFF/gather_off@/gather_off_again@}"
  } > $OUT/rows.log 2>&1
fi
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
tail -3 $OUT/tests.log 2>/dev/null
grep -E "^(torch|dstrain) +(stage|none)|ops ready|FAILED" $OUT/ops.log $OUT/rows.log | grep -v "  -  "
