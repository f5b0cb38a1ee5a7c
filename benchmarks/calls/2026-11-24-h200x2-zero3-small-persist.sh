#!/bin/bash
# One nvidia-h200-x2 device call (issue 13), after `source benchmarks/gpu_env.sh`: two-GPU ZeRO-3 with a
# small GPT's blocks kept whole (dstrain's default under 1B parameters) against the old setting, 406M,
# alternating pairs, and DDP for the ratio. PART=13 instead: on the 1.3B GPT (above the cut) the hand
# loop with and without blocks whole, to see whether the cut could go higher.
set -u
W=/tmp/w14; mkdir -p $W
Z=deepspeed.zero_optimization
OLD="$Z.stage3_param_persistence_threshold=100000"
P13="$Z.stage3_param_persistence_threshold=16777216;$Z.memory_efficient_linear=false"
OPS="FusedAdamBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1 &
S="python3 benchmarks/suite.py --work $W --row-timeout 150 --gpus 2 --presets stage3"
BIG="--n-layer 24 --d-model 2048 --n-head 16 --vocab-size 50304"
if [ "${PART:-406}" = 406 ]; then
  $S --steps 60 --out $OUT/m406 --runners torch > $OUT/ddp406.log 2>&1
  wait
  $S --steps 60 --out $OUT/m406 --runners dstrain --no-base \
    --variant "new@dstrain=" --variant "old@dstrain=$OLD" --variant "new2@dstrain=" --variant "old2@dstrain=$OLD" \
    > $OUT/d406.log 2>&1
else
  $S --steps 30 $BIG --out $OUT/b13 --runners torch > $OUT/ddp13.log 2>&1
  wait
  $S --steps 30 $BIG --out $OUT/b13 --runners deepspeed --no-base \
    --variant "own@deepspeed=" --variant "whole@deepspeed=$P13" \
    --variant "own2@deepspeed=" --variant "whole2@deepspeed=$P13" > $OUT/h13.log 2>&1
fi
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
for f in ops ddp406 ddp13 d406 h13; do [ -f $OUT/$f.log ] || continue; echo "== $f"; grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)|ops ready|FAILED" $OUT/$f.log | grep -v "  -  "; done
