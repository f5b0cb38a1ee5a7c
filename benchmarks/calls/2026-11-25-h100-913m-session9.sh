#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`: the final tree of session
# 9 on the GPU: the GPU tests of ZeRO-3's step, backward and flatten; the issue's 913M shape (16 x 2048,
# sequence 2048, micro batch 4): torch, dstrain stage2 and stage3, stage3's hand loop. Results JSON in one
# archive.
set -u
W=/tmp/w913; mkdir -p $W
M913="--n-layer 16 --d-model 2048 --n-head 16 --vocab-size 50304 --seq-len 2048 --micro-batch 4"
S="python3 benchmarks/suite.py --work $W --gpus 1 --row-timeout 200 --steps 40 $M913 --out $W/res/m913"
( OPS="FusedAdamBuilder" bash benchmarks/gpu_ops.sh ) > $OUT/ops.log 2>&1 &
OPSPID=$!
$S --runners torch --presets stage2 > $OUT/torch.log 2>&1
wait $OPSPID
PYTHONPATH=$PYTHONPATH:$PWD/.whl/pytest-site timeout 300 python3 -m pytest -p no:cacheprovider -q \
  tests/test_zero3_step.py tests/test_zero3_flatten.py -k "gpu or fast_current" > $OUT/test.log 2>&1
$S --runners dstrain --presets stage2,stage3 > $OUT/rows.log 2>&1
$S --runners deepspeed --presets stage3 > $OUT/hand.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) res 2>/dev/null
for f in ops test torch rows hand; do echo "== $f"
  grep -E "^(torch|dstrain|deepspeed) +(stage|none)|passed|failed|FAILED|Error" $OUT/$f.log | grep -v "  -  " | head -8
done
