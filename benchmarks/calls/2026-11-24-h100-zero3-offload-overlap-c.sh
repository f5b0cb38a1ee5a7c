#!/bin/bash
# nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`: the overlapped ZeRO-3 offload
# step with DeepSpeed's Adam kernel bound without the GIL (dstrain/rank/adam_nogil.py; DeepSpeed's binding
# held it through every update and stopped the training thread). The GPU tests; the hand loop's phases,
# overlapped; dstrain stage3_offload on the 1.3B GPT, on/off alternating; the 406M GPT on/off with torch.
set -u
W=/tmp/w8; mkdir -p $W
python3 -c "from dstrain.rank.adam_nogil import load_adam_without_gil as l; l()" > $OUT/op-nogil.log 2>&1 &
OPS="CPUAdamBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1
wait
BIG="--n-layer 24 --d-model 2048 --n-head 16 --vocab-size 50304"
S="python3 benchmarks/suite.py --work $W --row-timeout 150 --gpus 1 --presets stage3_offload"
V0="+env:DSTRAIN_OFFLOAD_OVERLAP=off"
PYTHONPATH=$PYTHONPATH:$PWD/.whl/pytest-site timeout 200 python3 -m pytest -p no:cacheprovider -q \
  tests/test_offload_step_zero3.py -k "beside and on_a_gpu" > $OUT/gputest.log 2>&1
$S $BIG --steps 20 --out $OUT/phases --runners deepspeed --no-base \
  --variant "ph@deepspeed=+dstrain_offload;+phases" > $OUT/phases.log 2>&1
$S $BIG --steps 30 --out $OUT/big --runners dstrain \
  --variant "v0@dstrain=$V0" --variant "on2@dstrain=" --variant "v02@dstrain=$V0" > $OUT/big.log 2>&1
$S --steps 60 --out $OUT/s3 --runners torch,dstrain --variant "v0@dstrain=$V0" > $OUT/s3.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
for f in ops op-nogil gputest phases big s3; do echo "== $f"; grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)|phases|ops ready|FAILED|passed|failed|Error" $OUT/$f.log | grep -v "  -  "; done
