#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`: ZeRO-3 on one GPU with
# two of DeepSpeed's three host syncs a step gone (the backward's end now waits on the device for the
# reduce stream; the persistent parameters' no-gather after the step sets their data without a stream
# sync) on top of the lean gradient copies, against DSTRAIN_ZERO3_GRADS=off DSTRAIN_CUDA_STREAM=off.
# The GPU tests (bitwise against DeepSpeed's step on the GPU); torch; 406M stage3 alternating pairs;
# 1.3B one pair; torch again. Results JSON in one archive.
set -u
W=/tmp/wns; mkdir -p $W
S="python3 benchmarks/suite.py --work $W --gpus 1 --row-timeout 200"
B13="--n-layer 24 --d-model 2048 --vocab-size 50304"
OFF="+env:DSTRAIN_ZERO3_GRADS=off;+env:DSTRAIN_CUDA_STREAM=off"
( OPS="FusedAdamBuilder" bash benchmarks/gpu_ops.sh ) > $OUT/ops.log 2>&1 &
OPSPID=$!
$S --steps 60 --out $W/res/m406 --runners torch --presets stage2 > $OUT/torch.log 2>&1
wait $OPSPID
PYTHONPATH=$PYTHONPATH:$PWD/.whl/pytest-site timeout 240 python3 -m pytest -p no:cacheprovider -q \
  tests/test_zero3_step.py -k "gpu or fast_current" > $OUT/test.log 2>&1
$S --steps 100 --out $W/res/m406 --runners dstrain --presets stage3 --no-base --variant "new@dstrain=" \
  --variant "off@dstrain=$OFF" --variant "new2@dstrain=" --variant "off2@dstrain=$OFF" \
  --variant "new3@dstrain=" --variant "off3@dstrain=$OFF" > $OUT/rows406.log 2>&1
$S --steps 60 --out $W/res/b13 $B13 --runners dstrain --presets stage3 --no-base --variant "new@dstrain=" \
  --variant "off@dstrain=$OFF" > $OUT/rows13.log 2>&1
$S --steps 60 --out $W/res/again --runners torch --presets stage2 > $OUT/torch2.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) res 2>/dev/null
for f in ops test torch rows406 rows13 torch2; do echo "== $f"
  grep -E "^(torch|dstrain|deepspeed) +(stage|none)|passed|failed|FAILED|Error" $OUT/$f.log | grep -v "  -  " | head -12
done
