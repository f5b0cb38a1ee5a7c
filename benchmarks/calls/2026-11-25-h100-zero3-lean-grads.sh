#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`: ZeRO-3's backward with
# dstrain's lean gradient copies (rank/zero3_grads.py) and DeepSpeed's accelerator asking for the current
# CUDA stream by device index, against both off (DSTRAIN_ZERO3_GRADS=off DSTRAIN_CUDA_STREAM=off: the tree
# of session 8). The GPU tests; torch; 406M stage3 alternating pairs (100 steps); the hand loop with
# phases, both ways; 1.3B one pair; 406M stage2 with the stream change on and off.
set -u
W=/tmp/wlg; mkdir -p $W
S="python3 benchmarks/suite.py --work $W --gpus 1 --row-timeout 200"
B13="--n-layer 24 --d-model 2048 --vocab-size 50304"
OFF="+env:DSTRAIN_ZERO3_GRADS=off;+env:DSTRAIN_CUDA_STREAM=off"
( OPS="FusedAdamBuilder" bash benchmarks/gpu_ops.sh ) > $OUT/ops.log 2>&1 &
OPSPID=$!
$S --steps 60 --out $OUT/m406 --runners torch --presets stage2 > $OUT/torch.log 2>&1
wait $OPSPID
PYTHONPATH=$PYTHONPATH:$PWD/.whl/pytest-site timeout 240 python3 -m pytest -p no:cacheprovider -q \
  tests/test_zero3_step.py -k "gpu or fast_current" > $OUT/test.log 2>&1
$S --steps 100 --out $OUT/m406 --runners dstrain --presets stage3 --no-base --variant "lean@dstrain=" \
  --variant "off@dstrain=$OFF" --variant "lean2@dstrain=" --variant "off2@dstrain=$OFF" > $OUT/rows406.log 2>&1
$S --steps 40 --out $OUT/hand --runners deepspeed --presets stage3 --no-base \
  --variant "lean@deepspeed=+dstrain_zero3_step;+phases" --variant "off@deepspeed=+dstrain_zero3_step;+phases;$OFF" \
  > $OUT/hand.log 2>&1
$S --steps 60 --out $OUT/b13 $B13 --runners dstrain --presets stage3 --no-base --variant "lean@dstrain=" \
  --variant "off@dstrain=$OFF" > $OUT/rows13.log 2>&1
$S --steps 100 --out $OUT/s2 --runners dstrain --presets stage2 --no-base --variant "stream@dstrain=" \
  --variant "off@dstrain=+env:DSTRAIN_CUDA_STREAM=off" > $OUT/rows2.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
grep -h "ZeRO-3\|dstrain ZeRO-3" $W/*.log | sed 's/^\[ *[0-9.]*s\] //' | sort | uniq -c | head -6
for f in ops test torch rows406 hand rows13 rows2; do echo "== $f"
  grep -E "^(torch|dstrain|deepspeed) +(stage|none)|phases|passed|failed|FAILED|Error" $OUT/$f.log | grep -v "  -  " | head -12
done
