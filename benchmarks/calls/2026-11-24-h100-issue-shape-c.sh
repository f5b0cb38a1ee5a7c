#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`, on the issue's 913M shape:
# command to first step of dstrain stage3 with ZeRO-3's partitions flattened on the GPU
# (dstrain/rank/zero3_flatten.py) against DeepSpeed's flatten through host memory
# (DSTRAIN_FLATTEN_ON_DEVICE=off), alternating, after a row that warms the bytecode cache; two rows
# with the early start on (DSTRAIN_EARLY_START=1, off for ZeRO-3 since finding 27); then the engine
# build profiled with a warm bytecode cache (benchmarks/engine_build_profile.py, second of two runs).
set -u
W=/tmp/wshapec; mkdir -p $W
OPS="FusedAdamBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1
SHAPE="--n-layer 16 --d-model 2048 --n-head 16 --vocab-size 50304 --seq-len 2048 --micro-batch 4"
OFF="+env:DSTRAIN_FLATTEN_ON_DEVICE=off"
python3 benchmarks/suite.py --work $W --gpus 1 $SHAPE --steps 20 --presets stage3 --no-base --runners dstrain --row-timeout 120 \
  --out $OUT/first --variant "warm@dstrain=" --variant "flat@dstrain=" --variant "host@dstrain=$OFF" \
  --variant "flat2@dstrain=" --variant "host2@dstrain=$OFF" --variant "flat3@dstrain=" --variant "host3@dstrain=$OFF" \
  --variant "early@dstrain=+env:DSTRAIN_EARLY_START=1" --variant "early2@dstrain=+env:DSTRAIN_EARLY_START=1" --keep-runs > $OUT/first.log 2>&1
D=$(ls -d $W/dstrain-stage3-1g-flat* | head -1)
for i in 1 2; do PYTHONPYCACHEPREFIX=/tmp/pyc python3 benchmarks/engine_build_profile.py $D --top 60 > $OUT/profile-$i.log 2>&1; done
for f in $W/dstrain-stage3-1g-*.log; do echo "$(basename $f): $(grep -m1 'ready in' $f)"; done > $OUT/ready.log
grep -E "ops ready|FAILED" $OUT/ops.log; grep -v "^    |" $OUT/first.log | tail -n 12; cat $OUT/ready.log; head -3 $OUT/profile-2.log | grep imports
# Same machine, next call (results in early-1.3b/): 1.3B GPT (24 x 2048, vocabulary 50,304, sequence 1024,
# micro batch 8) stage3, DSTRAIN_EARLY_START off and on alternating, four pairs:
#   W=/tmp/w13 && mkdir -p $W && E="+env:DSTRAIN_EARLY_START=1" && python3 benchmarks/suite.py --work $W --gpus 1 \
#     --n-layer 24 --d-model 2048 --n-head 16 --vocab-size 50304 --seq-len 1024 --micro-batch 8 --steps 30 \
#     --presets stage3 --no-base --runners dstrain --row-timeout 100 --out $OUT/early13 --variant "off1@dstrain=" \
#     --variant "on1@dstrain=$E" ... --variant "off4@dstrain=" --variant "on4@dstrain=$E" > $OUT/early13.log 2>&1
# A fresh machine, the call after (gpu-test-zero3-flatten.log):
#   python3 -m pytest -q -p no:cacheprovider tests/test_zero3_flatten.py
