#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`: DeepSpeed's partial
# optimizer offload (zero_optimization.offload_optimizer.ratio: the share of optimizer sub-groups on the
# host; the rest are stepped on the GPU) for stage3_offload. It splits by sub-groups, so the 2026-11-23
# row with one sub-group (ratio 0.5 at sub_group_size 1e9 on the 406M GPT) put nothing on the GPU: here
# sub_group_size 1e8. Throughput only (DeepSpeed's step; dstrain's chunked step declines a ratio).
# 1.3B: preset, sub-groups of 1e8 alone, ratio 0.5 and 0.25; 406M: preset and ratio 0.5. Results to $OUT.
set -u
W=/tmp/w8; mkdir -p $W
OPS="CPUAdamBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1
Z=deepspeed.zero_optimization
SG="$Z.sub_group_size=100000000"
BIG="--n-layer 24 --d-model 2048 --n-head 16 --vocab-size 50304"
S="python3 benchmarks/suite.py --work $W --row-timeout 150 --gpus 1 --presets stage3_offload --runners dstrain"
$S $BIG --steps 30 --out $OUT/b13 --variant "sg@dstrain=$SG" --variant "r50@dstrain=$SG;$Z.offload_optimizer.ratio=0.5" \
  --variant "r25@dstrain=$SG;$Z.offload_optimizer.ratio=0.25" > $OUT/b13.log 2>&1
$S --steps 60 --out $OUT/m406 --no-base --variant "r50@dstrain=$SG;$Z.offload_optimizer.ratio=0.5" > $OUT/m406.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
for f in ops b13 m406; do echo "== $f"; grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)|ops ready|FAILED" $OUT/$f.log | grep -v "  -  "; done
