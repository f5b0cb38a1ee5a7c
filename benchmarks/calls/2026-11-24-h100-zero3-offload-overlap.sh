#!/bin/bash
# nvidia-h100-x1 device calls (issue 13), after `source benchmarks/gpu_env.sh`: ZeRO-3 CPU offload with the
# optimizer step run beside the next forward (dstrain/rank/offload_overlap_zero3.py) against the step before
# it (DSTRAIN_OFFLOAD_OVERLAP=off). PART=1: the GPU tests (bit-identical, overlapped and not), torch and
# dstrain stage3_offload on the 1.3B GPT, on/off alternating. PART=2: the hand loop with dstrain's offload
# changes, phases timed apart (+phases), on/off at 1.3B; dstrain at 1.3B with the worker on 8, 12, 16 threads. Results go to $OUT.
set -u
W=/tmp/w6; mkdir -p $W
OPS="CPUAdamBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops-$PART.log 2>&1
BIG="--n-layer 24 --d-model 2048 --n-head 16 --vocab-size 50304"
S="python3 benchmarks/suite.py --work $W --row-timeout 150 --gpus 1 --presets stage3_offload"
V0="+env:DSTRAIN_OFFLOAD_OVERLAP=off"
if [ "$PART" = 1 ]; then
  PYTHONPATH=$PYTHONPATH:$PWD/.whl/pytest-site timeout 200 python3 -m pytest -p no:cacheprovider -q \
    tests/test_offload_step_zero3.py -k on_a_gpu > $OUT/gputest.log 2>&1
  $S $BIG --steps 30 --out $OUT/big --runners torch,dstrain \
    --variant "v0@dstrain=$V0" --variant "on2@dstrain=" --variant "v02@dstrain=$V0" > $OUT/big.log 2>&1
  LOGS="ops-1 gputest big"
else
  $S $BIG --steps 20 --out $OUT/phases --runners deepspeed --no-base \
    --variant "ph@deepspeed=+dstrain_offload;+phases" --variant "ph_v0@deepspeed=+dstrain_offload;+phases;$V0" \
    > $OUT/phases.log 2>&1
  $S $BIG --steps 30 --out $OUT/threads --runners dstrain --no-base \
    --variant "t8@dstrain=+env:DSTRAIN_OFFLOAD_OVERLAP=8" --variant "t12@dstrain=+env:DSTRAIN_OFFLOAD_OVERLAP=12" \
    --variant "t16@dstrain=+env:DSTRAIN_OFFLOAD_OVERLAP=16" > $OUT/threads.log 2>&1
  LOGS="ops-2 phases threads"
fi
tar -czf $OUT/rowlogs-$PART.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
for f in $LOGS; do echo "== $f"; grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)|phases|ops ready|FAILED|passed|failed|Error" $OUT/$f.log | grep -v "  -  "; done
