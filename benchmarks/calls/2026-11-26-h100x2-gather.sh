#!/bin/bash
# Prepared in session 11 (no device time then), for the first call of the next two-GPU lease
# (nvidia-h100-x2), after `source benchmarks/gpu_env.sh`, carry [".whl"]; about 7 minutes (session 10's
# rows took 23-43 s each). Run it before 2026-11-25-h100x2-matrix.sh: these rows decide dstrain's own
# two-GPU ZeRO-3 defaults, the matrix adds the peers.
#  1. the two-GPU test of dstrain's ZeRO-3 step on NCCL (tests/test_zero3_step.py, two ranks)
#  2. 406M stage3 with the gather of finding 43 against DSTRAIN_ZERO3_GATHER=off, three alternating
#     pairs, after a DDP row
#  3. 1.3B stage3 as dstrain renders it (blocks partitioned over 1B parameters) against blocks kept
#     whole (the persistence dstrain uses under 1B, set by hand), two alternating pairs, after DDP
# Five files come back: tests.log, ops.log, rows.log, rowlogs.tgz and the suite's JSON (one file a
# shape, under r/m406 and r/b13).
set -u
W=/tmp/wx2g; mkdir -p $W $OUT/r
OPS="FusedAdamBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1 &
OPSPID=$!
python3 -m pytest -q -p no:cacheprovider tests/test_zero3_step.py -k two_ranks > $OUT/tests.log 2>&1
S="python3 benchmarks/suite.py --work $W --gpus 2 --row-timeout 150"
M406="$S --steps 60 --out $OUT/r/m406"
B13="$S --steps 30 --out $OUT/r/b13 --n-layer 24 --d-model 2048 --n-head 16 --vocab-size 50304"
OFF="+env:DSTRAIN_ZERO3_GATHER=off"
# 4 x 2048^2: a block's largest weight, as config/speed_defaults.py sets it under 1B parameters
WHOLE="deepspeed.zero_optimization.stage3_param_persistence_threshold=16777216"
WHOLE="$WHOLE;deepspeed.zero_optimization.memory_efficient_linear=false"
{ $M406 --runners torch --presets stage3
  wait $OPSPID
  $M406 --runners dstrain --presets stage3 --no-base --variant "on1@dstrain=" --variant "off1@dstrain=$OFF" \
        --variant "on2@dstrain=" --variant "off2@dstrain=$OFF" --variant "on3@dstrain=" --variant "off3@dstrain=$OFF"
  $B13 --runners torch --presets stage3
  $B13 --runners dstrain --presets stage3 --no-base --variant "split1@dstrain=" --variant "whole1@dstrain=$WHOLE" \
       --variant "split2@dstrain=" --variant "whole2@dstrain=$WHOLE"
} > $OUT/rows.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
tail -3 $OUT/tests.log
grep -E "^(torch|dstrain) +(stage|none)|ops ready|FAILED" $OUT/ops.log $OUT/rows.log | grep -v "  -  "
