#!/bin/bash
# nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`: the overlapped ZeRO-3 offload
# step again, now with the gathers' streams waiting on the worker's copies on the device (the worker no longer
# waits for each chunk's copies on the host). The GPU tests; the hand loop's phases, overlapped; dstrain
# stage3_offload on the 1.3B GPT, on/off alternating. Results go to $OUT.
set -u
W=/tmp/w7; mkdir -p $W
OPS="CPUAdamBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1
BIG="--n-layer 24 --d-model 2048 --n-head 16 --vocab-size 50304"
S="python3 benchmarks/suite.py --work $W --row-timeout 150 --gpus 1 --presets stage3_offload"
V0="+env:DSTRAIN_OFFLOAD_OVERLAP=off"
PYTHONPATH=$PYTHONPATH:$PWD/.whl/pytest-site timeout 200 python3 -m pytest -p no:cacheprovider -q \
  tests/test_offload_step_zero3.py -k "beside and on_a_gpu" > $OUT/gputest.log 2>&1
$S $BIG --steps 20 --out $OUT/phases --runners deepspeed --no-base \
  --variant "ph@deepspeed=+dstrain_offload;+phases" > $OUT/phases.log 2>&1
$S $BIG --steps 30 --out $OUT/big --runners dstrain \
  --variant "v0@dstrain=$V0" --variant "on2@dstrain=" --variant "v02@dstrain=$V0" > $OUT/big.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
for f in ops gputest phases big; do echo "== $f"; grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)|phases|ops ready|FAILED|passed|failed|Error" $OUT/$f.log | grep -v "  -  "; done
