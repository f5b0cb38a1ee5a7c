#!/bin/bash
# One nvidia-h200 device call (issue 13), after `source benchmarks/gpu_env.sh`: the 1.3B GPT on one GPU,
# second half of the matrix: Lightning's and the hand loop's stage3_offload, the hand loop's and
# dstrain's stage3_nvme, and stage3 again (hand loop and dstrain, alternating: the first call's dstrain
# row had a 12% interval spread). Results go straight to $OUT so that a call cut off keeps its rows.
set -u
W=/tmp/w3; mkdir -p $W
OPS="FusedAdamBuilder CPUAdamBuilder AsyncIOBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1
BIG="--n-layer 24 --d-model 2048 --n-head 16 --vocab-size 50304 --steps 30"
S="python3 benchmarks/suite.py --work $W --gpus 1 $BIG"
$S --out $OUT/s3 --row-timeout 120 --runners deepspeed,dstrain --presets stage3 \
  --variant "again@deepspeed=" --variant "again@dstrain=" > $OUT/s3.log 2>&1
$S --out $OUT/off --row-timeout 150 --runners lightning,deepspeed --presets stage3_offload > $OUT/off.log 2>&1
$S --out $OUT/nvme --row-timeout 200 --runners deepspeed,dstrain --presets stage3_nvme > $OUT/nvme.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
for f in ops s3 off nvme; do echo "== $f"; grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)|ops ready|FAILED" $OUT/$f.log | grep -v "  -  "; done
