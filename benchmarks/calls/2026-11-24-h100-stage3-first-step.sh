#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`: ZeRO-3 jobs now start
# without the early start (finding 27). Command to first step of dstrain stage3 on the 406M GPT, one GPU,
# ops built, 10 steps a row: the new default against DSTRAIN_EARLY_START=1, alternating (the first row
# fills the bytecode cache). Results go straight to $OUT.
set -u
W=/tmp/w12; mkdir -p $W
OPS="FusedAdamBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1
S="python3 benchmarks/suite.py --work $W --row-timeout 120 --gpus 1 --steps 10 --log-every 5 --warmup 5 --presets stage3 --runners dstrain"
$S --out $OUT/first --variant "es1@dstrain=+env:DSTRAIN_EARLY_START=1" --variant "b2@dstrain=" \
  --variant "es12@dstrain=+env:DSTRAIN_EARLY_START=1" --variant "b3@dstrain=" > $OUT/first.log 2>&1
for f in ops first; do echo "== $f"; grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)|ops ready|FAILED" $OUT/$f.log | grep -v "  -  "; done
