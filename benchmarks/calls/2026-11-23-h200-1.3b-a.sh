#!/bin/bash
# One nvidia-h200 device call (issue 13), after `source benchmarks/gpu_env.sh`: the 1.3B GPT on one GPU,
# first half of the matrix: torch, then Lightning, the hand loop and dstrain for stage1/2/3 and
# stage2_offload. Results go straight to $OUT so that a call cut off at its limit keeps its finished rows.
set -u
W=/tmp/w1; mkdir -p $W
OPS="FusedAdamBuilder CPUAdamBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1 &
OPSPID=$!
BIG="--n-layer 24 --d-model 2048 --n-head 16 --vocab-size 50304 --steps 30"
S="python3 benchmarks/suite.py --work $W --gpus 1 $BIG"
$S --out $OUT/torch --row-timeout 120 --runners torch --presets stage1 > $OUT/torch.log 2>&1
wait $OPSPID
$S --out $OUT/gpu --row-timeout 120 --runners lightning,deepspeed,dstrain --presets stage1,stage2,stage3 > $OUT/gpu.log 2>&1
$S --out $OUT/off --row-timeout 150 --runners lightning,deepspeed,dstrain --presets stage2_offload > $OUT/off.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
for f in ops torch gpu off; do echo "== $f"; grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)|ops ready|FAILED" $OUT/$f.log | grep -v "  -  "; done
