#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`. 1. the hand loop's
# stage3_nvme on the 1.3B GPT with dstrain's JSON now (stage3_max_reuse_distance 0), the matrix's last
# row; 2. more stage3_offload rounds on the 406M GPT, dstrain's chunked ZeRO-3 step against
# DSTRAIN_OFFLOAD_CHUNKS=off, alternating, with torch; stage2_offload twice. Results go straight to $OUT.
set -u
W=/tmp/w5; mkdir -p $W
OPS="FusedAdamBuilder CPUAdamBuilder AsyncIOBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1
S="python3 benchmarks/suite.py --work $W --row-timeout 150 --gpus 1 --steps 60"
OFF="+env:DSTRAIN_OFFLOAD_CHUNKS=off"
$S --out $OUT/s3 --runners torch,dstrain --presets stage3_offload \
  --variant "off@dstrain=$OFF" --variant "on2@dstrain=" --variant "off2@dstrain=$OFF" > $OUT/s3.log 2>&1
$S --out $OUT/s2 --runners dstrain --presets stage2_offload --variant "again@dstrain=" > $OUT/s2.log 2>&1
BIG="--n-layer 24 --d-model 2048 --n-head 16 --vocab-size 50304 --steps 30"
python3 benchmarks/suite.py --work $W --row-timeout 200 --gpus 1 $BIG --out $OUT/nvme --runners deepspeed \
  --presets stage3_nvme > $OUT/nvme.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
for f in ops s3 s2 nvme; do echo "== $f"; grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)|ops ready|FAILED" $OUT/$f.log | grep -v "  -  "; done
