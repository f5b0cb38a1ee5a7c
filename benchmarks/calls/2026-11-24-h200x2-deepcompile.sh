#!/bin/bash
# One nvidia-h200-x2 device call (issue 13), after `source benchmarks/gpu_env.sh`, prepared and not yet run
# (the two-GPU kind was not lent): DeepCompile on two GPUs, where finding 29 found ZeRO-3 host-bound in
# the module hooks DeepCompile removes. dstrain's stage3 on the 406M GPT, eager (blocks whole, the
# default) against DeepCompile (deepspeed.compile.deepcompile=true: DeepSpeed's own schedule, its
# profiled prefetch and selective-gather passes compiled at step 5), and DDP for the ratio. 60 steps,
# the first 15 outside the median (both compiles). PART=13: the same on the 1.3B GPT.
set -u
W=/tmp/w25; mkdir -p $W
OPS="FusedAdamBuilder DeepCompileBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1 &
S="python3 benchmarks/suite.py --work $W --row-timeout 300 --gpus 2 --presets stage3 --steps 60 --warmup 15"
[ "${PART:-406}" = 13 ] && S="$S --n-layer 24 --d-model 2048 --n-head 16 --vocab-size 50304 --steps 40"
$S --out $OUT/r --runners torch > $OUT/ddp.log 2>&1
wait
$S --out $OUT/r --runners dstrain --no-base --variant "eager@dstrain=deepspeed.compile.deepcompile=false" \
  --variant "dc@dstrain=deepspeed.compile.deepcompile=true" > $OUT/pairs.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
grep -E "^(torch|dstrain) +(stage|none)|ops ready|FAILED" $OUT/ops.log $OUT/ddp.log $OUT/pairs.log | grep -v "  -  "
