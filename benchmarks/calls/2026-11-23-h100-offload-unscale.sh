#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), 406M GPT, 1 GPU, after `source benchmarks/gpu_env.sh`:
# stage2_offload, the hand loop (DeepSpeed as is) against dstrain (no per-parameter waits, and no
# unscale pass over the host's gradients when the factor is 1), two rounds.
set -u
W=/tmp/w4; R=$W/results; mkdir -p $W $R
OPS="FusedAdamBuilder CPUAdamBuilder" bash benchmarks/gpu_ops.sh > $R/ops.log 2>&1
save() { mkdir -p $R/$1-rows; mv $W/*.log $R/$1-rows/ 2>/dev/null; }
S="python3 benchmarks/suite.py --work $W --row-timeout 170 --gpus 1"
for round in 1 2; do
  $S --out $R/round$round --runners deepspeed,dstrain --presets stage2_offload --steps 30 > $R/round$round.log 2>&1; save round$round
done
{ tail -1 $R/ops.log; for f in round1 round2; do echo "== $f"; grep -E "^(dstrain|deepspeed) +stage" $R/$f.log | grep -v "  -  "; done; } > $OUT/summary.log 2>&1
tar -czf $OUT/all.tgz -C $W results
cat $OUT/summary.log
