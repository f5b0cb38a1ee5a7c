#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), 406M GPT, 1 GPU, after `source benchmarks/gpu_env.sh`:
# the chunked ZeRO-1/2 offload step with the bf16 rounding on the GPU (dstrain/rank/offload_step.py).
# 1. its GPU test (bit-identical to DeepSpeed's step; pytest carried in .whl/pytest-site);
# 2. the step's parts without a model; 3. stage2_offload: torch, the hand loop, then dstrain against
# DSTRAIN_OFFLOAD_CHUNKS=off in two alternating rounds, and dstrain with grad accumulation 4 and 16.
set -u
W=/tmp/w7; R=$W/results; mkdir -p $W $R
OPS="FusedAdamBuilder CPUAdamBuilder" bash benchmarks/gpu_ops.sh > $R/ops.log 2>&1
save() { mkdir -p $R/$1-rows; mv $W/*.log $R/$1-rows/ 2>/dev/null; }
PYTHONPATH=$PYTHONPATH:$PWD/.whl/pytest-site timeout 240 python3 -m pytest -q -p no:cacheprovider \
  tests/test_offload_syncs.py -k gpu > $R/gputest.log 2>&1
OMP_NUM_THREADS=16 python3 benchmarks/offload_step_parts.py > $R/parts.log 2>&1
S="python3 benchmarks/suite.py --work $W --row-timeout 170 --gpus 1 --steps 60"
OFF="+env:DSTRAIN_OFFLOAD_CHUNKS=off"
$S --out $R/s2 --runners torch,deepspeed,dstrain --presets stage2_offload \
  --variant "off@dstrain=$OFF" --variant "on2@dstrain=" --variant "off2@dstrain=$OFF" \
  --variant "ga4@dstrain=train.grad_accum_steps=4" --variant "ga16@dstrain=train.grad_accum_steps=16" > $R/s2.log 2>&1; save s2
{ tail -1 $R/ops.log; tail -3 $R/gputest.log; grep -v "^\[" $R/parts.log; echo "== s2"; grep -E "^(torch|dstrain|deepspeed) +(stage|none)" $R/s2.log | grep -v "  -  "; } > $OUT/summary.log 2>&1
tar -czf $OUT/all.tgz -C $W results
cat $OUT/summary.log
