#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`, 1.3B GPT, stage3, one GPU.
# Four of five earlier pairs had dstrain with early start off 4-8% above dstrain as is (one pair equal):
# three more pairs, and the hand loop with and without what an early-started rank does at its gate
# (+early_prepare: imports, torch._dynamo, the CUDA context, before the process group), two pairs.
# On CPU ranks (host-bound tiny GPT) the hand loop's rows were equal with and without. Results to $OUT.
set -u
W=/tmp/w11; mkdir -p $W
OPS="FusedAdamBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1
E="+env:DSTRAIN_EARLY_START=0"
S="python3 benchmarks/suite.py --work $W --row-timeout 150 --gpus 1 --steps 30 --n-layer 24 --d-model 2048 --n-head 16 --vocab-size 50304 --presets stage3"
$S --out $OUT/ds --runners dstrain --variant "e1@dstrain=$E" --variant "b2@dstrain=" \
  --variant "e2@dstrain=$E" --variant "b3@dstrain=" --variant "e3@dstrain=$E" > $OUT/ds.log 2>&1
$S --out $OUT/hand --runners deepspeed --variant "ep@deepspeed=+early_prepare" --variant "b2@deepspeed=" \
  --variant "ep2@deepspeed=+early_prepare" > $OUT/hand.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
for f in ops ds hand; do echo "== $f"; grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)|ops ready|FAILED" $OUT/$f.log | grep -v "  -  "; done
