#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`: dstrain's stage3 on one
# GPU now runs DeepCompile by default (the built-in GPT, bf16, no offload). dstrain itself (launcher,
# worker, its loop, the final evaluation under no_grad) on the 406M GPT; then the 1.3B GPT with the new
# default and with the old one (deepspeed.compile.deepcompile=false: eager, blocks fetched whole).
set -u
W=/tmp/w19; mkdir -p $W
OPS="FusedAdamBuilder DeepCompileBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1
S="python3 benchmarks/suite.py --work $W --gpus 1 --presets stage3 --no-base --runners dstrain --log-every 5 --warmup 10"
BIG="--n-layer 24 --d-model 2048 --n-head 16 --vocab-size 50304"
$S --steps 40 --row-timeout 240 --out $OUT/m406 --variant "dc@dstrain=" > $OUT/d406.log 2>&1
$S $BIG --steps 30 --row-timeout 180 --out $OUT/b13 --variant "dc@dstrain=" > $OUT/d13.log 2>&1
$S $BIG --steps 30 --row-timeout 100 --out $OUT/b13 --variant "eager@dstrain=deepspeed.compile.deepcompile=false" > $OUT/e13.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
for f in ops d406 d13 e13; do echo "== $f"; grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)|ops ready|FAILED" $OUT/$f.log | grep -v "  -  "; done
for f in $W/*.log; do echo "== $f"; grep -E "step +[0-9]+|eval|Error|error|ready in|Launching" $f | head -30; done
