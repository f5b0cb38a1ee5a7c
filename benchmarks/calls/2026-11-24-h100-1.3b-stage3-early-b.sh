#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`, 1.3B GPT, stage3, one GPU:
# the previous call's two early-start-off rows (42,198 and 44,107 tokens/s) were above three of its four
# dstrain rows, inside the rows' 5-13% spread. Three more pairs, dstrain as is against
# DSTRAIN_EARLY_START=0, alternating, to tell. Results go straight to $OUT.
set -u
W=/tmp/w10; mkdir -p $W
OPS="FusedAdamBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1
E="+env:DSTRAIN_EARLY_START=0"
S="python3 benchmarks/suite.py --work $W --row-timeout 150 --gpus 1 --steps 30 --n-layer 24 --d-model 2048 --n-head 16 --vocab-size 50304"
$S --out $OUT/s3 --presets stage3 --runners dstrain --variant "e1@dstrain=$E" --variant "b2@dstrain=" \
  --variant "e2@dstrain=$E" --variant "b3@dstrain=" --variant "e3@dstrain=$E" > $OUT/s3.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
for f in ops s3; do echo "== $f"; grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)|ops ready|FAILED" $OUT/$f.log | grep -v "  -  "; done
