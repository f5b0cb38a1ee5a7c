#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`: dstrain's stage3 with
# the lean ZeRO-3 step (the default) against DeepSpeed's step (DSTRAIN_ZERO3_STEP=off), alternating, on
# the 913M shape (16 x 2048, 16 heads, vocabulary 50,304, sequence 2048, micro batch 4; two
# pairs) and the 1.3B GPT (24 x 2048, vocabulary 50,304; one pair), with torch rows for the ratios.
set -u
W=/tmp/wleanb; mkdir -p $W
OPS="FusedAdamBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1 &
OPSPID=$!
S="python3 benchmarks/suite.py --work $W --row-timeout 150 --gpus 1 --presets stage3"
M913="--n-layer 16 --d-model 2048 --n-head 16 --vocab-size 50304 --seq-len 2048 --micro-batch 4"
B13="--n-layer 24 --d-model 2048 --n-head 16 --vocab-size 50304"
$S --steps 30 $M913 --out $OUT/m913 --runners torch > $OUT/torch913.log 2>&1
wait $OPSPID
$S --steps 30 $M913 --out $OUT/m913 --runners dstrain --no-base \
  --variant "lean@dstrain=" --variant "off@dstrain=+env:DSTRAIN_ZERO3_STEP=off" \
  --variant "lean2@dstrain=" --variant "off2@dstrain=+env:DSTRAIN_ZERO3_STEP=off" > $OUT/d913.log 2>&1
$S --steps 30 $B13 --out $OUT/b13 --runners torch > $OUT/torch13.log 2>&1
$S --steps 30 $B13 --out $OUT/b13 --runners dstrain --no-base \
  --variant "lean@dstrain=" --variant "off@dstrain=+env:DSTRAIN_ZERO3_STEP=off" > $OUT/d13.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
for f in ops torch913 d913 torch13 d13; do echo "== $f"; grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)|ops ready|FAILED" $OUT/$f.log | grep -v "  -  "; done
