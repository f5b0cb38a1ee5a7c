#!/bin/bash
# Prepared, not yet run (session 10 spent its device time on 2026-11-25-h100x2-zero3.sh): the two-GPU
# "checked by" matrix of issue 13, on nvidia-h100-x2 held warm between two calls, after
# `source benchmarks/gpu_env.sh`. Eager DDP; dstrain, the hand loop (DeepSpeed with dstrain's JSON) and
# Lightning's deepspeed_stage_1/2/3 on stage1/2/3; dstrain stage3 twice, before and after the peers, so
# the host's drift shows in the target row. 40-step rows (30 at 1.3B). A call returns at most eight files:
# each suite writes one JSON under $OUT/r, logs go to one file, the rows' own logs into one tarball.
#   PART=406  406M GPT (24 x 1024, vocabulary 100,352, micro batch 8 x 1024 per GPU)
#   PART=13   1.3B GPT (24 x 2048, vocabulary 50,304)
set -u
W=/tmp/wx2; mkdir -p $W $OUT/r
SHAPE="--out $OUT/r/m406"; STEPS=40
[ "${PART:-406}" = 13 ] && SHAPE="--n-layer 24 --d-model 2048 --n-head 16 --vocab-size 50304 --out $OUT/r/b13" && STEPS=30
# At 1.3B also the blocks kept whole (session 12: decided by 2026-11-26-h100x2-gather.sh's pairs)
EXTRA=""
WHOLE="deepspeed.zero_optimization.stage3_param_persistence_threshold=16777216;deepspeed.zero_optimization.memory_efficient_linear=false"
[ "${PART:-406}" = 13 ] && EXTRA="--variant whole@dstrain=$WHOLE"
S="python3 benchmarks/suite.py --work $W --gpus 2 --steps $STEPS --row-timeout 120 $SHAPE"
OPS="FusedAdamBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1 &
OPSPID=$!
{ $S --runners torch --presets stage3
  wait $OPSPID
  $S --runners dstrain --presets stage3
  $S --runners dstrain,deepspeed,lightning --presets stage1,stage2
  $S --runners deepspeed,lightning --presets stage3
  $S --runners dstrain --presets stage3 --no-base --variant "again@dstrain=" $EXTRA
} > $OUT/rows.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)|ops ready|FAILED" $OUT/ops.log $OUT/rows.log | grep -v "  -  "
