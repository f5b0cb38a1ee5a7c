#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`: dstrain's stage3 on the
# 406M GPT, one GPU, eager (deepspeed.compile.deepcompile=false: blocks fetched and kept whole) against
# DeepCompile, two alternating pairs in one call, 60 steps each (DeepCompile's compile is in its first
# interval, outside the median).
set -u
W=/tmp/w24; mkdir -p $W
OPS="FusedAdamBuilder DeepCompileBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1
S="python3 benchmarks/suite.py --work $W --gpus 1 --presets stage3 --no-base --runners dstrain --row-timeout 200 --out $OUT/m406"
$S --variant "eager@dstrain=deepspeed.compile.deepcompile=false" --variant "dc@dstrain=deepspeed.compile.deepcompile=true" \
   --variant "eager2@dstrain=deepspeed.compile.deepcompile=false" --variant "dc2@dstrain=deepspeed.compile.deepcompile=true" > $OUT/pairs.log 2>&1
grep -E "^dstrain +stage|ops ready" $OUT/ops.log $OUT/pairs.log
