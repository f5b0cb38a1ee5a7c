#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`, 1.3B GPT, stage3, one GPU.
# The previous call found the hand loop driven by dstrain's train loop as fast as the hand loop, so the
# 6-11% that dstrain's stage3 rows lose is in its launcher or worker: dstrain with early start off
# (DSTRAIN_EARLY_START=0: the ranks start after the checks, nothing imported or CUDA-initialised at a gate)
# and with the bytecode cache off, against dstrain as is and the hand loop, alternating. Results to $OUT.
set -u
W=/tmp/w9; mkdir -p $W
OPS="FusedAdamBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1
S="python3 benchmarks/suite.py --work $W --row-timeout 150 --gpus 1 --steps 30 --n-layer 24 --d-model 2048 --n-head 16 --vocab-size 50304"
$S --out $OUT/s3 --presets stage3 --runners deepspeed,dstrain --variant "early0@dstrain=+env:DSTRAIN_EARLY_START=0" \
  --variant "bc0@dstrain=+env:DSTRAIN_BYTECODE_CACHE=off" --variant "again@deepspeed,dstrain=" \
  --variant "early02@dstrain=+env:DSTRAIN_EARLY_START=0" > $OUT/s3.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
for f in ops s3; do echo "== $f"; grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)|ops ready|FAILED" $OUT/$f.log | grep -v "  -  "; done
