#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`, on the 1.3B GPT.
# 1. dstrain's stage3 rows were 5-15% below the hand loop's at 1.3B (2026-11-23 late night): the hand
#    loop, dstrain, and the hand loop driven by dstrain's train loop (+dstrain_loop), alternating, to tell
#    the loop's cost from the launcher's and worker's. 2. stage3_offload with activation checkpointing off
#    (the preset turns it on) against the preset as is. Results go straight to $OUT.
set -u
W=/tmp/w6; mkdir -p $W
OPS="FusedAdamBuilder CPUAdamBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1
S="python3 benchmarks/suite.py --work $W --row-timeout 150 --gpus 1 --steps 30 --n-layer 24 --d-model 2048 --n-head 16 --vocab-size 50304"
$S --out $OUT/s3 --presets stage3 --runners deepspeed,dstrain --variant "loop@deepspeed=+dstrain_loop" \
  --variant "again@deepspeed,dstrain=" > $OUT/s3.log 2>&1
$S --out $OUT/off --presets stage3_offload --runners dstrain --variant "acoff@dstrain=train.activation_checkpointing=false" \
  > $OUT/off.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
for f in ops s3 off; do echo "== $f"; grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)|ops ready|FAILED" $OUT/$f.log | grep -v "  -  "; done
