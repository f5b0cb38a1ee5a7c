#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`: ZeRO-3 without module
# hooks on the modules whose parameters are all persistent (dstrain/rank/zero3_hooks.py) on top of the
# lean step. The GPU test; torch on the 406M GPT; the hand loop with dstrain's stage3 JSON and the lean
# step, hooks kept (DSTRAIN_ZERO3_HOOKS=off) against removed, phase by phase, alternating; dstrain's
# stage3 as it ships (both) against DeepSpeed's step and hooks (DSTRAIN_ZERO3_STEP=off), alternating, on
# the 406M GPT and the 913M shape; cProfile of the hand loop with both.
set -u
W=/tmp/wunhook; mkdir -p $W
OPS="FusedAdamBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1 &
OPSPID=$!
S="python3 benchmarks/suite.py --work $W --row-timeout 150 --gpus 1 --presets stage3"
M913="--n-layer 16 --d-model 2048 --n-head 16 --vocab-size 50304 --seq-len 2048 --micro-batch 4"
$S --steps 40 --out $OUT/m406 --runners torch > $OUT/torch406.log 2>&1
wait $OPSPID
PYTHONPATH=$PYTHONPATH:$PWD/.whl/pytest-site timeout 200 python3 -m pytest -p no:cacheprovider -q \
  tests/test_zero3_step.py -k gpu > $OUT/test.log 2>&1
KEEP="+env:DSTRAIN_ZERO3_HOOKS=off"
$S --steps 40 --out $OUT/m406 --runners deepspeed --no-base \
  --variant "hooks@deepspeed=+dstrain_zero3_step;$KEEP;+phases" --variant "unhooked@deepspeed=+dstrain_zero3_step;+phases" \
  --variant "hooks2@deepspeed=+dstrain_zero3_step;$KEEP;+phases" --variant "unhooked2@deepspeed=+dstrain_zero3_step;+phases" \
  > $OUT/hand.log 2>&1
OFF="+env:DSTRAIN_ZERO3_STEP=off"
$S --steps 40 --out $OUT/m406 --runners dstrain --no-base \
  --variant "both@dstrain=" --variant "off@dstrain=$OFF" --variant "both2@dstrain=" --variant "off2@dstrain=$OFF" \
  > $OUT/d406.log 2>&1
$S --steps 30 $M913 --out $OUT/m913 --runners dstrain --no-base \
  --variant "both@dstrain=" --variant "off@dstrain=$OFF" > $OUT/d913.log 2>&1
$S --steps 40 --out $OUT/prof --runners deepspeed --no-base \
  --variant "unhookedprof@deepspeed=+dstrain_zero3_step;+pyprofile" > $OUT/prof.log 2>&1
rm -f $OUT/prof/*.json
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
grep -h "ZeRO-3" $W/*.log | sed 's/^\[ *[0-9.]*s\] //' | sort | uniq -c | head -5
for f in ops test torch406 hand d406 d913 prof; do echo "== $f"; grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)|phases|ops ready|FAILED|passed|failed" $OUT/$f.log | grep -v "  -  "; done
