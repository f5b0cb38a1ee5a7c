#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`: dstrain's stage3 on
# the 406M GPT with its new default (a built-in GPT under 1B parameters keeps every block whole:
# persistence threshold 4 x width^2, torch's linear) against the old one (threshold 1e5 set by hand,
# which switches the default off), three alternating pairs; the same two settings on the 1.3B GPT in
# the hand loop (above the 1B cut, so dstrain leaves it sharded), two pairs. torch rows for the ratios.
set -u
W=/tmp/w13; mkdir -p $W
Z=deepspeed.zero_optimization
OLD="$Z.stage3_param_persistence_threshold=100000"
P13="$Z.stage3_param_persistence_threshold=16777216;$Z.memory_efficient_linear=false"
OPS="FusedAdamBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1 &
S="python3 benchmarks/suite.py --work $W --row-timeout 150 --gpus 1 --presets stage3"
BIG="--n-layer 24 --d-model 2048 --n-head 16 --vocab-size 50304"
$S --steps 40 --out $OUT/m406 --runners torch > $OUT/torch406.log 2>&1
$S --steps 30 $BIG --out $OUT/b13 --runners torch > $OUT/torch13.log 2>&1
wait
$S --steps 40 --out $OUT/m406 --runners dstrain --no-base \
  --variant "new@dstrain=" --variant "old@dstrain=$OLD" --variant "new2@dstrain=" --variant "old2@dstrain=$OLD" \
  --variant "new3@dstrain=" --variant "old3@dstrain=$OLD" > $OUT/d406.log 2>&1
$S --steps 30 $BIG --out $OUT/b13 --runners deepspeed --no-base \
  --variant "own@deepspeed=" --variant "whole@deepspeed=$P13" \
  --variant "own2@deepspeed=" --variant "whole2@deepspeed=$P13" > $OUT/h13.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
grep -h "persistence\|memory_efficient" $W/dstrain-stage3-1g-new.log | head -3
for f in ops torch406 torch13 d406 h13; do echo "== $f"; grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)|ops ready|FAILED" $OUT/$f.log | grep -v "  -  "; done
