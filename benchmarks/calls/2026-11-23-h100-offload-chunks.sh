#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), 406M GPT, 1 GPU, after `source benchmarks/gpu_env.sh`:
# the ZeRO-1/2 offload step in chunks (dstrain/rank/offload_step.py) against DeepSpeed's own step
# (DSTRAIN_OFFLOAD_CHUNKS=off) and two other chunk sizes, the hand loop and torch for the ratios, a
# second round of on/off against drift; stage3_offload with smaller optimizer sub-groups (the same
# cache effect by configuration).
set -u
W=/tmp/w5; R=$W/results; mkdir -p $W $R
OPS="FusedAdamBuilder CPUAdamBuilder" bash benchmarks/gpu_ops.sh > $R/ops.log 2>&1
save() { mkdir -p $R/$1-rows; mv $W/*.log $R/$1-rows/ 2>/dev/null; }
S="python3 benchmarks/suite.py --work $W --row-timeout 170 --gpus 1 --steps 60"
OFF="+env:DSTRAIN_OFFLOAD_CHUNKS=off"
$S --out $R/s2 --runners torch,deepspeed,dstrain --presets stage2_offload \
  --variant "off@dstrain=$OFF" --variant "c8m@dstrain=+env:DSTRAIN_OFFLOAD_CHUNKS=8388608" \
  --variant "c512k@dstrain=+env:DSTRAIN_OFFLOAD_CHUNKS=524288" > $R/s2.log 2>&1; save s2
$S --out $R/s2b --runners dstrain --presets stage2_offload --no-base \
  --variant "off2@dstrain=$OFF" --variant "on2@dstrain=" > $R/s2b.log 2>&1; save s2b
Z=deepspeed.zero_optimization
$S --out $R/s3 --runners dstrain --presets stage3_offload \
  --variant "sg4m@dstrain=$Z.sub_group_size=4000000" --variant "sg20m@dstrain=$Z.sub_group_size=20000000" > $R/s3.log 2>&1; save s3
{ tail -1 $R/ops.log; for f in s2 s2b s3; do echo "== $f"; grep -E "^(torch|dstrain|deepspeed) +(stage|none)" $R/$f.log | grep -v "  -  "; done; } > $OUT/summary.log 2>&1
tar -czf $OUT/all.tgz -C $W results
cat $OUT/summary.log
