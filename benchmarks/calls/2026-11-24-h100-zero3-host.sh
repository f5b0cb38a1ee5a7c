#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`: dstrain's ZeRO-3 host
# trims (dstrain/rank/zero3_host.py) on one GPU. Their GPU test; the hand loop on the 406M GPT with
# DeepSpeed's own code and with the trims, alternating, two pairs; once more with every parameter but
# the embedding persistent and DeepSpeed's memory-efficient linear off; two pairs on the 1.3B GPT;
# dstrain's stage3 (trims on by default) at 406M. torch rows for the ratios.
set -u
W=/tmp/w12; mkdir -p $W
Z=deepspeed.zero_optimization
P="$Z.stage3_param_persistence_threshold=20000000;$Z.memory_efficient_linear=false"
OPS="FusedAdamBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1 &
S="python3 benchmarks/suite.py --work $W --row-timeout 150 --gpus 1 --presets stage3"
BIG="--n-layer 24 --d-model 2048 --n-head 16 --vocab-size 50304"
$S --steps 40 --out $OUT/m406 --runners torch > $OUT/torch406.log 2>&1
$S --steps 30 $BIG --out $OUT/b13 --runners torch > $OUT/torch13.log 2>&1
wait
python3 -m pytest -q -p no:cacheprovider tests/test_zero3_host.py > $OUT/test.log 2>&1
$S --steps 40 --out $OUT/m406 --runners deepspeed --no-base \
  --variant "own@deepspeed=+phases" --variant "trim@deepspeed=+zero3_host;+phases" \
  --variant "own2@deepspeed=" --variant "trim2@deepspeed=+zero3_host" \
  --variant "trim_pl@deepspeed=$P;+zero3_host;+phases" > $OUT/h406.log 2>&1
$S --steps 40 --out $OUT/m406 --runners dstrain > $OUT/d406.log 2>&1
$S --steps 30 $BIG --out $OUT/b13 --runners deepspeed --no-base \
  --variant "own@deepspeed=" --variant "trim@deepspeed=+zero3_host" \
  --variant "own2@deepspeed=" --variant "trim2@deepspeed=+zero3_host" > $OUT/h13.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
grep -h "ZeRO-3 host" $W/dstrain-*.log | head -2
for f in ops test torch406 torch13 h406 d406 h13; do echo "== $f"; grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)|phases|ops ready|FAILED|passed|failed" $OUT/$f.log | grep -v "  -  "; done
