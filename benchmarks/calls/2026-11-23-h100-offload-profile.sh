#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), 406M GPT, 1 GPU, after `source benchmarks/gpu_env.sh`:
# where stage2_offload's step goes now. 1. the optimizer step's four parts without a model
# (benchmarks/offload_step_parts.py), whole and in chunks; 2. torch.profiler tables of the hand loop as is
# and with dstrain's two offload changes (+dstrain_offload); 3. dstrain with overlap_comm off and with
# 5e8-element buckets (fewer bucket flushes in the backward's gradient hooks) against its base row.
set -u
W=/tmp/w6; R=$W/results; mkdir -p $W $R
OPS="FusedAdamBuilder CPUAdamBuilder" bash benchmarks/gpu_ops.sh > $R/ops.log 2>&1
save() { mkdir -p $R/$1-rows; mv $W/*.log $R/$1-rows/ 2>/dev/null; }
OMP_NUM_THREADS=16 python3 benchmarks/offload_step_parts.py > $R/parts.log 2>&1
S="python3 benchmarks/suite.py --work $W --row-timeout 170 --gpus 1"
$S --out $R/prof --runners deepspeed --presets stage2_offload --steps 30 --profile \
  --variant "dso@deepspeed=+dstrain_offload" > $R/prof.log 2>&1; save prof
Z=deepspeed.zero_optimization
$S --out $R/var --runners dstrain --presets stage2_offload --steps 60 \
  --variant "noovl@dstrain=$Z.overlap_comm=false" \
  --variant "rb5e8@dstrain=$Z.reduce_bucket_size=500000000;$Z.allgather_bucket_size=500000000" > $R/var.log 2>&1; save var
{ tail -1 $R/ops.log; grep -v "^\[" $R/parts.log; for f in prof var; do echo "== $f"; grep -E "^(dstrain|deepspeed) +stage" $R/$f.log | grep -v "  -  "; done; } > $OUT/summary.log 2>&1
tar -czf $OUT/all.tgz -C $W results
cat $OUT/summary.log
