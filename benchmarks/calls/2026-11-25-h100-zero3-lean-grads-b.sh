#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`: more alternating pairs of
# 406M stage3 with ZeRO-3's lean gradient copies and the current-stream lookup against both off (the
# first call's rows swing 14-27% from interval to interval); stage3_offload with the stream lookup on and
# off (the lean copies need no offload); torch eager first and last. Results JSON in one archive.
set -u
W=/tmp/wlgb; mkdir -p $W
S="python3 benchmarks/suite.py --work $W --gpus 1 --row-timeout 200"
OFF="+env:DSTRAIN_ZERO3_GRADS=off;+env:DSTRAIN_CUDA_STREAM=off"
( OPS="FusedAdamBuilder CPUAdamBuilder" bash benchmarks/gpu_ops.sh
  python3 -c "from dstrain.rank.adam_nogil import load_adam_without_gil as f; f(); print('op dstrain_cpu_adam_nogil: ready')"
) > $OUT/ops.log 2>&1 &
OPSPID=$!
$S --steps 60 --out $W/res/m406 --runners torch --presets stage2 > $OUT/torch.log 2>&1
wait $OPSPID
$S --steps 100 --out $W/res/m406 --runners dstrain --presets stage3 --no-base --variant "off@dstrain=$OFF" \
  --variant "lean@dstrain=" --variant "off2@dstrain=$OFF" --variant "lean2@dstrain=" \
  --variant "off3@dstrain=$OFF" --variant "lean3@dstrain=" > $OUT/rows406.log 2>&1
$S --steps 20 --out $W/res/off406 --runners dstrain --presets stage3_offload --no-base --variant "stream@dstrain=" \
  --variant "off@dstrain=+env:DSTRAIN_CUDA_STREAM=off" > $OUT/rowsoff.log 2>&1
$S --steps 60 --out $W/res/again --runners torch --presets stage2 > $OUT/torch2.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) res 2>/dev/null
for f in ops torch rows406 rowsoff torch2; do echo "== $f"
  grep -E "^(torch|dstrain|deepspeed) +(stage|none)|ready in|FAILED|Error" $OUT/$f.log | grep -v "  -  " | head -12
done
