#!/bin/bash
# Session 12, after 2026-11-26-h100x2-gather.sh found 1.3B stage3 on two GPUs at 0.83 of DDP with its
# blocks partitioned and 1.09-1.11 with them kept whole: do whole blocks still win at 2.7B, where
# their 16-bit weights cost each GPU 5.3 GB? dstrain's GPT 32 x 2560, 20 heads, vocabulary 50,304,
# sequence 2048, micro batch 4 (the issue's own 913M shape's batch), DDP, then two alternating
# pairs split / whole. Run after `source benchmarks/gpu_env.sh`, carry [".whl"], nvidia-h200-x2.
set -u
W=/tmp/wx2b; mkdir -p $W $OUT/r
OPS="FusedAdamBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1 &
OPSPID=$!
S="python3 benchmarks/suite.py --work $W --gpus 2 --row-timeout 150 --steps 24 --out $OUT/r/b27"
S="$S --n-layer 32 --d-model 2560 --n-head 20 --vocab-size 50304 --seq-len 2048 --micro-batch 4"
# 4 x 2560^2: a block's largest weight
WHOLE="deepspeed.zero_optimization.stage3_param_persistence_threshold=26214400"
WHOLE="$WHOLE;deepspeed.zero_optimization.memory_efficient_linear=false"
{ $S --runners torch --presets stage3
  wait $OPSPID
  $S --runners dstrain --presets stage3 --no-base --variant "split1@dstrain=" --variant "whole1@dstrain=$WHOLE" \
     --variant "split2@dstrain=" --variant "whole2@dstrain=$WHOLE"
} > $OUT/rows.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
grep -E "^(torch|dstrain) +(stage|none)|ops ready|FAILED|Error" $OUT/ops.log $OUT/rows.log | grep -v "  -  "
