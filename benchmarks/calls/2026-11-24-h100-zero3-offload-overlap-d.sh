#!/bin/bash
# nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`: why the overlapped ZeRO-3
# offload step (GIL released) does not gain. The hand loop's phases with the step beside the forward and
# before it, on one machine; dstrain stage3_offload at 1.3B with the worker on 8 threads, on its default
# (15), and off. Results go to $OUT.
set -u
W=/tmp/w9; mkdir -p $W
python3 -c "from dstrain.rank.adam_nogil import load_adam_without_gil as l; l()" > $OUT/op-nogil.log 2>&1 &
OPS="CPUAdamBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1
wait
BIG="--n-layer 24 --d-model 2048 --n-head 16 --vocab-size 50304"
S="python3 benchmarks/suite.py --work $W --row-timeout 150 --gpus 1 --presets stage3_offload"
V0="+env:DSTRAIN_OFFLOAD_OVERLAP=off"
$S $BIG --steps 20 --out $OUT/phases --runners deepspeed --no-base \
  --variant "ph@deepspeed=+dstrain_offload;+phases" --variant "ph_v0@deepspeed=+dstrain_offload;+phases;$V0" \
  --variant "ph_t8@deepspeed=+dstrain_offload;+phases;+env:DSTRAIN_OFFLOAD_OVERLAP=8" > $OUT/phases.log 2>&1
$S $BIG --steps 30 --out $OUT/big --runners dstrain --no-base --variant "t8@dstrain=+env:DSTRAIN_OFFLOAD_OVERLAP=8" \
  --variant "v0@dstrain=$V0" --variant "on@dstrain=" > $OUT/big.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
for f in ops phases big; do echo "== $f"; grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)|phases|ops ready|FAILED|passed|failed|Error" $OUT/$f.log | grep -v "  -  "; done
