#!/bin/bash
# One nvidia-h200 device call (issue 13), after `source benchmarks/gpu_env.sh`: the ZeRO-3 offload step
# in chunks with the bf16 rounding on the GPU (dstrain/rank/offload_step_zero3.py). 1. its GPU test
# (bit-identical to DeepSpeed's step); 2. stage3_offload on the 406M GPT, dstrain against
# DSTRAIN_OFFLOAD_CHUNKS=off (DeepSpeed's step), alternating, with torch for the ratio; 3. dstrain
# stage3_offload on the 1.3B GPT. Results go straight to $OUT so that a call cut off keeps its rows.
set -u
W=/tmp/w2; mkdir -p $W
OPS="FusedAdamBuilder CPUAdamBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1
PYTHONPATH=$PYTHONPATH:$PWD/.whl/pytest-site timeout 200 python3 -m pytest -p no:cacheprovider -q \
  tests/test_offload_step_zero3.py -k on_a_gpu > $OUT/gputest.log 2>&1
S="python3 benchmarks/suite.py --work $W --row-timeout 150 --gpus 1 --steps 60"
OFF="+env:DSTRAIN_OFFLOAD_CHUNKS=off"
$S --out $OUT/s3 --runners torch,dstrain --presets stage3_offload \
  --variant "off@dstrain=$OFF" --variant "on2@dstrain=" --variant "off2@dstrain=$OFF" > $OUT/s3.log 2>&1
BIG="--n-layer 24 --d-model 2048 --n-head 16 --vocab-size 50304"
python3 benchmarks/suite.py --work $W --row-timeout 150 --gpus 1 --steps 30 $BIG --out $OUT/big \
  --runners dstrain --presets stage3_offload > $OUT/big.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
for f in ops gputest s3 big; do echo "== $f"; grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)|ops ready|FAILED|passed|failed" $OUT/$f.log | grep -v "  -  "; done
