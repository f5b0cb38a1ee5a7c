#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), 406M GPT, 1 GPU, after `source benchmarks/gpu_env.sh`.
# 1. Compiled start-up: dstrain stage2 with train.compile auto (on), twice (the second finds torch's
#    compile cache and the bytecode cache warm).
# 2. Offload rows side by side: the hand loop (DeepSpeed as is), dstrain (without DeepSpeed's
#    per-parameter waits) and Lightning's deepspeed_stage_{2,3}_offload, for both offload presets.
# Everything lands in $OUT/all.tgz plus summary.log.
set -u
W=/tmp/w; R=$W/results; mkdir -p $W $R
OPS="FusedAdamBuilder CPUAdamBuilder" bash benchmarks/gpu_ops.sh > $R/ops.log 2>&1
save() { mkdir -p $R/$1-rows; mv $W/*.log $R/$1-rows/ 2>/dev/null; }
S="python3 benchmarks/suite.py --work $W --row-timeout 170 --gpus 1"
for pass in 1 2; do
  $S --out $R/compiled$pass --runners dstrain --presets stage2 --steps 10 > $R/compiled$pass.log 2>&1; save compiled$pass
done
$S --out $R/offload --runners deepspeed,dstrain,lightning --presets stage2_offload,stage3_offload --steps 30 > $R/offload.log 2>&1; save offload
{ cat $R/ops.log | tail -3; for f in compiled1 compiled2 offload; do echo "== $f"; grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)" $R/$f.log | grep -v "  -  "; done
  grep -H "ready in" $R/*-rows/dstrain-*.log; } > $OUT/summary.log 2>&1
tar -czf $OUT/all.tgz -C $W results
cat $OUT/summary.log
