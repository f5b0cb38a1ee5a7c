#!/bin/bash
# One two-GPU device call (issue 13; nvidia-h100-x2, or nvidia-h200-x2 where that came), after
# `source benchmarks/gpu_env.sh`: the first two-GPU rows of the tree with dstrain's ZeRO-3 step, unhooked
# blocks, lean backward and stream lookup (findings 36-40), against DDP on the 406M and the 1.3B GPT.
# The session had 322 s of device time left, so the rows come in order of what the issue asks: DDP while
# DeepSpeed's FusedAdam builds, then stage3 at both shapes, then (while time lasts) a second 406M stage3
# row, stage2, and the hand-loop and Lightning stage3 peers. Every row is written to $OUT as it ends.
set -u
W=/tmp/w32; mkdir -p $W
BIG="--n-layer 24 --d-model 2048 --n-head 16 --vocab-size 50304"
S="python3 benchmarks/suite.py --work $W --row-timeout 90 --gpus 2"
OPS="FusedAdamBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1 &
OPSPID=$!
$S --steps 40 --out $OUT/m406 --runners torch --presets stage3 > $OUT/ddp406.log 2>&1
$S --steps 30 $BIG --out $OUT/b13 --runners torch --presets stage3 > $OUT/ddp13.log 2>&1
wait $OPSPID
$S --steps 60 --out $OUT/m406 --runners dstrain --presets stage3 > $OUT/z406.log 2>&1
$S --steps 30 $BIG --out $OUT/b13 --runners dstrain --presets stage3 > $OUT/z13.log 2>&1
$S --steps 60 --out $OUT/m406 --runners dstrain --presets stage3 --no-base --variant "again@dstrain=" > $OUT/z406b.log 2>&1
$S --steps 60 --out $OUT/m406 --runners dstrain --presets stage2 > $OUT/s2406.log 2>&1
$S --steps 60 --out $OUT/m406 --runners deepspeed,lightning --presets stage3 > $OUT/peers406.log 2>&1
