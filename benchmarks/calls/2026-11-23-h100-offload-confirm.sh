#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`: a second machine's
# rounds of stage2_offload, dstrain (chunked step, bf16 rounding on the GPU) against
# DSTRAIN_OFFLOAD_CHUNKS=off, alternating, with torch for the ratio. 406M GPT, 1 GPU.
set -u
W=/tmp/w8; R=$W/results; mkdir -p $W $R
OPS="FusedAdamBuilder CPUAdamBuilder" bash benchmarks/gpu_ops.sh > $R/ops.log 2>&1
save() { mkdir -p $R/$1-rows; mv $W/*.log $R/$1-rows/ 2>/dev/null; }
S="python3 benchmarks/suite.py --work $W --row-timeout 170 --gpus 1 --steps 60"
OFF="+env:DSTRAIN_OFFLOAD_CHUNKS=off"
$S --out $R/s2 --runners torch,dstrain --presets stage2_offload \
  --variant "off@dstrain=$OFF" --variant "on2@dstrain=" --variant "off2@dstrain=$OFF" --variant "on3@dstrain=" > $R/s2.log 2>&1; save s2
{ tail -1 $R/ops.log; echo "== s2"; grep -E "^(torch|dstrain|deepspeed) +(stage|none)" $R/s2.log | grep -v "  -  "; } > $OUT/summary.log 2>&1
tar -czf $OUT/all.tgz -C $W results
cat $OUT/summary.log
