#!/bin/bash
# One nvidia-h200-x2 device call (issue 13), after `source benchmarks/gpu_env.sh`: where two-GPU ZeRO-3
# loses its time on the 406M GPT (0.45-0.55 of DDP). DDP; the hand loop with dstrain's stage3 JSON, phase
# by phase, under torch.profiler (device busy time) and cProfile (the host's Python); three candidates:
# every parameter but the embedding persistent, DeepSpeed's memory-efficient linear off, both; dstrain.
set -u
W=/tmp/w10; mkdir -p $W
Z=deepspeed.zero_optimization
OPS="FusedAdamBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1 &
OPSPID=$!
S="python3 benchmarks/suite.py --work $W --row-timeout 150 --gpus 2 --presets stage3 --steps 40"
$S --out $OUT/ddp --runners torch --variant "pp@torch=+pyprofile" > $OUT/ddp.log 2>&1
wait $OPSPID
$S --out $OUT/hand --runners deepspeed --no-base --profile --profile-runners deepspeed \
  --variant "prof@deepspeed=+phases;+pyprofile" > $OUT/hand.log 2>&1
$S --out $OUT/cand --runners deepspeed --no-base \
  --variant "persist@deepspeed=$Z.stage3_param_persistence_threshold=20000000;+phases" \
  --variant "nolinear@deepspeed=$Z.memory_efficient_linear=false;+phases" \
  --variant "both@deepspeed=$Z.stage3_param_persistence_threshold=20000000;$Z.memory_efficient_linear=false;+phases;+pyprofile" \
  > $OUT/cand.log 2>&1
$S --out $OUT/ds --runners dstrain > $OUT/ds.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
for f in ops ddp hand cand ds; do echo "== $f"; grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)|phases|profile:|ops ready|FAILED" $OUT/$f.log | grep -v "  -  "; done
