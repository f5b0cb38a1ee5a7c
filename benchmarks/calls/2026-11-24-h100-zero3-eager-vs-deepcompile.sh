#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`: with the lean ZeRO-3
# step and the persistent modules unhooked, is DeepCompile (which dstrain turned on for its GPT's ZeRO-3
# on one GPU in runs of 5,000+ passes) still the faster? 406M GPT, one machine: torch; dstrain's stage3
# eager (deepspeed.compile.deepcompile=false), DeepCompile, eager again; 60 steps each (DeepCompile's
# compile is in its first interval, outside the median).
set -u
W=/tmp/wdc; mkdir -p $W
OPS="FusedAdamBuilder DeepCompileBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1 &
OPSPID=$!
S="python3 benchmarks/suite.py --work $W --gpus 1 --presets stage3 --row-timeout 240"
$S --steps 40 --out $OUT/m406 --runners torch > $OUT/torch406.log 2>&1
wait $OPSPID
$S --steps 60 --out $OUT/m406 --runners dstrain --no-base \
  --variant "eager@dstrain=deepspeed.compile.deepcompile=false" --variant "dc@dstrain=deepspeed.compile.deepcompile=true" \
  --variant "eager2@dstrain=deepspeed.compile.deepcompile=false" > $OUT/pairs.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
grep -h "ZeRO-3" $W/*.log | sed 's/^\[ *[0-9.]*s\] //' | sort | uniq -c | head -4
grep -hE "^(torch|dstrain) +(stage|none)|ops ready|FAILED" $OUT/ops.log $OUT/torch406.log $OUT/pairs.log
