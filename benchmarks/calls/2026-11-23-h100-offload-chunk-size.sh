#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`: the chunk size of
# the offload step (dstrain/rank/offload_step.py): the step's parts at 8M, 16M and 32M elements, then
# stage2_offload rows at 8M (the default), 16M and 32M, alternating. 406M GPT, 1 GPU.
set -u
W=/tmp/w9; R=$W/results; mkdir -p $W $R
OPS="FusedAdamBuilder CPUAdamBuilder" bash benchmarks/gpu_ops.sh > $R/ops.log 2>&1
save() { mkdir -p $R/$1-rows; mv $W/*.log $R/$1-rows/ 2>/dev/null; }
OMP_NUM_THREADS=16 python3 benchmarks/offload_step_parts.py --chunks 8388608,16777216,33554432 > $R/parts.log 2>&1
S="python3 benchmarks/suite.py --work $W --row-timeout 170 --gpus 1 --steps 60"
C="+env:DSTRAIN_OFFLOAD_CHUNKS"
$S --out $R/s2 --runners dstrain --presets stage2_offload --no-base \
  --variant "c8m@dstrain=" --variant "c16m@dstrain=$C=16777216" --variant "c32m@dstrain=$C=33554432" \
  --variant "c8m_2@dstrain=$C=8388608" --variant "c16m_2@dstrain=$C=16777216" --variant "c32m_2@dstrain=$C=33554432" > $R/s2.log 2>&1; save s2
{ tail -1 $R/ops.log; grep -v "^\[" $R/parts.log; echo "== s2"; grep -E "^(torch|dstrain|deepspeed) +(stage|none)" $R/s2.log | grep -v "  -  "; } > $OUT/summary.log 2>&1
tar -czf $OUT/all.tgz -C $W results
cat $OUT/summary.log
