#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`: dstrain's ZeRO-3 step
# with the release, norm and persistent gather batched (dstrain/rank/zero3_step.py) against DeepSpeed's.
# The GPU test; torch on the 406M GPT; the hand loop with dstrain's stage3 JSON, phase by phase, with and
# without the step, alternating; dstrain's stage3 with it (the default) and without
# (DSTRAIN_ZERO3_STEP=off), alternating; cProfile of the hand loop with it.
set -u
W=/tmp/wlean; mkdir -p $W
OPS="FusedAdamBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1 &
OPSPID=$!
S="python3 benchmarks/suite.py --work $W --row-timeout 150 --gpus 1 --presets stage3 --steps 40"
$S --out $OUT/m406 --runners torch > $OUT/torch406.log 2>&1
wait $OPSPID
PYTHONPATH=$PYTHONPATH:$PWD/.whl/pytest-site timeout 200 python3 -m pytest -p no:cacheprovider -q \
  tests/test_zero3_step.py -k gpu > $OUT/test.log 2>&1
$S --out $OUT/m406 --runners deepspeed --no-base \
  --variant "ds@deepspeed=+phases" --variant "lean@deepspeed=+dstrain_zero3_step;+phases" \
  --variant "ds2@deepspeed=+phases" --variant "lean2@deepspeed=+dstrain_zero3_step;+phases" > $OUT/hand.log 2>&1
$S --out $OUT/m406 --runners dstrain --no-base \
  --variant "lean@dstrain=" --variant "off@dstrain=+env:DSTRAIN_ZERO3_STEP=off" \
  --variant "lean2@dstrain=" --variant "off2@dstrain=+env:DSTRAIN_ZERO3_STEP=off" > $OUT/d406.log 2>&1
$S --out $OUT/prof --runners deepspeed --no-base \
  --variant "leanprof@deepspeed=+dstrain_zero3_step;+pyprofile" > $OUT/prof.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
grep -h "ZeRO-3 step" $W/*.log | sort | uniq -c | head -5
for f in ops test torch406 hand d406 prof; do echo "== $f"; grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)|phases|ops ready|FAILED|passed|failed" $OUT/$f.log | grep -v "  -  "; done
