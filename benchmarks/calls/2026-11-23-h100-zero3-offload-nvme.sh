#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`. 1. stage3_offload on the
# 406M GPT on an H100 (where the earlier offload rows ran): dstrain's chunked ZeRO-3 step against
# DSTRAIN_OFFLOAD_CHUNKS=off, alternating, with torch for the ratio, and stage2_offload once (after the
# offload changes moved to dstrain/rank/offload.py). 2. stage3_nvme on the 1.3B GPT failed at its second
# step in DeepSpeed's parameter swapper ("Not enough buffers 0 for swapping 1", hand loop and dstrain
# alike): two candidate settings, parameters released after use (stage3_max_reuse_distance 0) and every
# parameter kept in host memory (offload_param.max_in_cpu 2e9). Results go straight to $OUT.
set -u
W=/tmp/w4; mkdir -p $W
OPS="FusedAdamBuilder CPUAdamBuilder AsyncIOBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1
S="python3 benchmarks/suite.py --work $W --row-timeout 150 --gpus 1 --steps 60"
OFF="+env:DSTRAIN_OFFLOAD_CHUNKS=off"
$S --out $OUT/s3 --runners torch,dstrain --presets stage3_offload \
  --variant "off@dstrain=$OFF" --variant "on2@dstrain=" --variant "off2@dstrain=$OFF" > $OUT/s3.log 2>&1
$S --out $OUT/s2 --runners dstrain --presets stage2_offload > $OUT/s2.log 2>&1
Z=deepspeed.zero_optimization
BIG="--n-layer 24 --d-model 2048 --n-head 16 --vocab-size 50304 --steps 30"
python3 benchmarks/suite.py --work $W --row-timeout 200 --gpus 1 $BIG --out $OUT/nvme --runners dstrain \
  --presets stage3_nvme --no-base --variant "reuse0@dstrain=$Z.stage3_max_reuse_distance=0" \
  --variant "cpu2e9@dstrain=$Z.offload_param.max_in_cpu=2000000000" > $OUT/nvme.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
for f in ops s3 s2 nvme; do echo "== $f"; grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)|ops ready|FAILED" $OUT/$f.log | grep -v "  -  "; done
