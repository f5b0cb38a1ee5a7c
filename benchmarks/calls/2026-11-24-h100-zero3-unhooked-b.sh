#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`, on the machine of the
# previous call, held warm: torch and dstrain's stage3 as it ships (lean step, persistent modules
# unhooked) against DSTRAIN_ZERO3_STEP=off (DeepSpeed's step and hooks) on the 913M shape and the
# 1.3B GPT (24 x 2048, vocabulary 50,304), one pair each after the torch row.
set -u
W=/tmp/wunhookb; mkdir -p $W
S="python3 benchmarks/suite.py --work $W --row-timeout 150 --gpus 1 --presets stage3 --steps 30"
M913="--n-layer 16 --d-model 2048 --n-head 16 --vocab-size 50304 --seq-len 2048 --micro-batch 4"
B13="--n-layer 24 --d-model 2048 --n-head 16 --vocab-size 50304"
OFF="+env:DSTRAIN_ZERO3_STEP=off"
$S $M913 --out $OUT/m913 --runners torch > $OUT/torch913.log 2>&1
$S $M913 --out $OUT/m913 --runners dstrain --no-base --variant "off@dstrain=$OFF" --variant "both@dstrain=" > $OUT/d913.log 2>&1
$S $B13 --out $OUT/b13 --runners torch > $OUT/torch13.log 2>&1
$S $B13 --out $OUT/b13 --runners dstrain --no-base --variant "both@dstrain=" --variant "off@dstrain=$OFF" > $OUT/d13.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
for f in torch913 d913 torch13 d13; do echo "== $f"; grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)|FAILED" $OUT/$f.log | grep -v "  -  "; done
