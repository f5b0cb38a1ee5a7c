#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`: stage 1/2 against torch
# on the 406M GPT with longer rows than the matrix's 30 steps (whose four 5-step intervals read dstrain's
# stage1/2 at 0.94-0.98 of torch): 100 steps a row, torch eager and compiled, dstrain stage1 and stage2 as
# shipped (compiled by train.compile=auto) and stage2 eager, the hand loop's stage2 (compiled as dstrain),
# torch eager again at the end.
set -u
W=/tmp/w406s12; mkdir -p $W
S="python3 benchmarks/suite.py --work $W --gpus 1 --steps 100 --row-timeout 150 --out $OUT/m406"
( OPS="FusedAdamBuilder" bash benchmarks/gpu_ops.sh ) > $OUT/ops.log 2>&1 &
OPSPID=$!
$S --runners torch --presets stage2 --variant "compiled@torch=+compile" > $OUT/torch.log 2>&1
wait $OPSPID
$S --runners dstrain --presets stage1,stage2 > $OUT/dstrain.log 2>&1
$S --runners dstrain,deepspeed --presets stage2 --no-base --variant "eager@dstrain=train.compile=false" \
  --variant "shipped@deepspeed=" > $OUT/more.log 2>&1
python3 benchmarks/suite.py --work $W --gpus 1 --steps 100 --row-timeout 150 --out $OUT/again --runners torch \
  --presets stage2 > $OUT/torch2.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
for f in ops torch dstrain more torch2; do echo "== $f"
  grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)|ready|FAILED" $OUT/$f.log | grep -v "  -  "; done
