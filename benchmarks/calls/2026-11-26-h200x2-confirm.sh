#!/bin/bash
# Session 12, last call: stage3 as dstrain now renders it for two GPUs (blocks whole up to 3B
# parameters), at 1.3B beside DDP, and on the issue's own 913M shape (16 x 2048, sequence 2048, micro
# batch 4) beside DDP, the hand loop and Lightning's deepspeed_stage_3. Run after
# `source benchmarks/gpu_env.sh`, carry [".whl"], nvidia-h200-x2.
set -u
W=/tmp/wx2c; mkdir -p $W $OUT/r
OPS="FusedAdamBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1 &
OPSPID=$!
S="python3 benchmarks/suite.py --work $W --gpus 2 --row-timeout 120"
B13="$S --steps 30 --out $OUT/r/b13 --n-layer 24 --d-model 2048 --n-head 16 --vocab-size 50304"
M913="$S --steps 30 --out $OUT/r/m913 --n-layer 16 --d-model 2048 --n-head 16 --vocab-size 50304 --seq-len 2048 --micro-batch 4"
{ $B13 --runners torch --presets stage3
  wait $OPSPID
  $B13 --runners dstrain --presets stage3
  $M913 --runners torch,dstrain,deepspeed,lightning --presets stage3
} > $OUT/rows.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)|ops ready|FAILED|Error" $OUT/ops.log $OUT/rows.log | grep -v "  -  "
