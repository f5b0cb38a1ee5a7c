#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`, on the issue's 913M shape:
# ZeRO-3 offload with the direct gradient copy in bf16 (offload_grads_zero3.py bf16_zero3_offload_grads).
# The ZeRO-3 GPU tests; torch; the hand loop with dstrain's changes phase by phase, bf16 copies and
# DSTRAIN_OFFLOAD_GRADS=off (DeepSpeed's copies) alternating; dstrain stage3_offload on/off.
set -u
W=/tmp/wz3bf16; mkdir -p $W
SHAPE="--n-layer 16 --d-model 2048 --n-head 16 --vocab-size 50304 --seq-len 2048 --micro-batch 4"
S="python3 benchmarks/suite.py --work $W --gpus 1 $SHAPE"
( OPS="FusedAdamBuilder CPUAdamBuilder" bash benchmarks/gpu_ops.sh
  python3 -c "from dstrain.rank.adam_nogil import load_adam_without_gil as f; f(); print('op dstrain_cpu_adam_nogil: ready')"
) > $OUT/ops.log 2>&1 &
OPSPID=$!
$S --out $OUT/torch --runners torch --presets stage2 --steps 30 --row-timeout 120 > $OUT/torch.log 2>&1
wait $OPSPID
PYTHONPATH=$PYTHONPATH:$PWD/.whl/pytest-site timeout 200 python3 -m pytest -p no:cacheprovider -q \
  tests/test_offload_step_zero3.py -k "on_a_gpu" > $OUT/gputest.log 2>&1
OFF="+env:DSTRAIN_OFFLOAD_GRADS=off"
$S --out $OUT/phases --runners deepspeed --presets stage3_offload --steps 20 --no-base --row-timeout 100 \
  --variant "on@deepspeed=+dstrain_offload;+phases" --variant "off@deepspeed=+dstrain_offload;+phases;$OFF" \
  --variant "on2@deepspeed=+dstrain_offload;+phases" --variant "off2@deepspeed=+dstrain_offload;+phases;$OFF" \
  > $OUT/phases.log 2>&1
$S --out $OUT/rows --runners dstrain --presets stage3_offload --steps 20 --no-base --row-timeout 90 \
  --variant "on@dstrain=train.log_every=5" --variant "off@dstrain=train.log_every=5;$OFF" > $OUT/rows.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
for f in ops gputest torch phases rows; do echo "== $f"; grep -E "^(torch|dstrain|deepspeed) +(stage|none)|phases|ops ready|FAILED|passed|failed|Error" $OUT/$f.log | grep -v "  -  "; done
grep -h "CPU offload, dstrain" $W/dstrain-*.log | sort | uniq -c

# Follow-up on the same warm machine (results in followup/), with DSTRAIN_OFFLOAD_GRADS=fp32 (the direct
# copy in fp32 for ZeRO-3, DeepSpeed's fp32 copies for ZeRO-1/2) against the bf16 copies, alternating:
#   F="+env:DSTRAIN_OFFLOAD_GRADS=fp32"
#   $S --out $OUT/phases2 --runners deepspeed --presets stage3_offload,stage2_offload --steps 20 --no-base \
#     --row-timeout 100 --variant "fp32@deepspeed=+dstrain_offload;+phases;$F" \
#     --variant "bf16@deepspeed=+dstrain_offload;+phases" --variant "fp32b@deepspeed=+dstrain_offload;+phases;$F" \
#     --variant "bf16b@deepspeed=+dstrain_offload;+phases" > $OUT/phases2.log 2>&1
