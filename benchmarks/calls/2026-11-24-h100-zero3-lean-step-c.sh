#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`, on the machine of the
# -b call, held warm: dstrain's stage3 on the 406M GPT with the lean ZeRO-3 step (the default) against
# DeepSpeed's step (DSTRAIN_ZERO3_STEP=off), three alternating pairs, and a torch row.
set -u
W=/tmp/wleanc; mkdir -p $W
S="python3 benchmarks/suite.py --work $W --row-timeout 150 --gpus 1 --presets stage3 --steps 40"
$S --out $OUT/m406 --runners torch > $OUT/torch406.log 2>&1
$S --out $OUT/m406 --runners dstrain --no-base \
  --variant "lean@dstrain=" --variant "off@dstrain=+env:DSTRAIN_ZERO3_STEP=off" \
  --variant "lean2@dstrain=" --variant "off2@dstrain=+env:DSTRAIN_ZERO3_STEP=off" \
  --variant "lean3@dstrain=" --variant "off3@dstrain=+env:DSTRAIN_ZERO3_STEP=off" > $OUT/d406.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
for f in torch406 d406; do echo "== $f"; grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)|FAILED" $OUT/$f.log | grep -v "  -  "; done
