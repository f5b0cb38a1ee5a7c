#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`: on one GPU dstrain's
# stage3 now keeps the built-in GPT's blocks whole at any size (one rank's shard is the whole model);
# dstrain stage3 on the 1.3B GPT with it and with the old setting (threshold 1e5 set by hand), three
# alternating pairs, and torch for the ratio.
set -u
W=/tmp/w16; mkdir -p $W
OLD="deepspeed.zero_optimization.stage3_param_persistence_threshold=100000"
OPS="FusedAdamBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1 &
S="python3 benchmarks/suite.py --work $W --row-timeout 150 --gpus 1 --presets stage3 --steps 30"
BIG="--n-layer 24 --d-model 2048 --n-head 16 --vocab-size 50304"
$S $BIG --out $OUT/b13 --runners torch > $OUT/torch13.log 2>&1
wait
$S $BIG --out $OUT/b13 --runners dstrain --no-base \
  --variant "new@dstrain=" --variant "old@dstrain=$OLD" --variant "new2@dstrain=" --variant "old2@dstrain=$OLD" \
  --variant "new3@dstrain=" --variant "old3@dstrain=$OLD" > $OUT/d13.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
for f in ops torch13 d13; do echo "== $f"; grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)|ops ready|FAILED" $OUT/$f.log | grep -v "  -  "; done
