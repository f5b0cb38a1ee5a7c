#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`: stage2_offload with
# every runner in one call after the chunked step (torch, Lightning's deepspeed_stage_2_offload, the
# hand loop, dstrain). 406M GPT, 1 GPU.
set -u
W=/tmp/w10; R=$W/results; mkdir -p $W $R
OPS="FusedAdamBuilder CPUAdamBuilder" bash benchmarks/gpu_ops.sh > $R/ops.log 2>&1
save() { mkdir -p $R/$1-rows; mv $W/*.log $R/$1-rows/ 2>/dev/null; }
S="python3 benchmarks/suite.py --work $W --row-timeout 170 --gpus 1 --steps 60"
$S --out $R/s2 --runners torch,lightning,deepspeed,dstrain --presets stage2_offload > $R/s2.log 2>&1; save s2
{ tail -1 $R/ops.log; echo "== s2"; grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)" $R/s2.log | grep -v "  -  "; } > $OUT/summary.log 2>&1
tar -czf $OUT/all.tgz -C $W results
cat $OUT/summary.log
