#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`, on the issue's 913M shape
# (16 x 2048, 16 heads, vocabulary 50,304, sequence 2048, micro batch 4): ZeRO-1/2 offload with the
# gradients sent to the host in bf16 (dstrain/rank/offload_step.py bf16_offload_grads). Its GPU test;
# torch; dstrain stage2_offload with bf16 gradients and with DSTRAIN_OFFLOAD_GRADS=off (DeepSpeed's fp32
# copies), alternating twice; the hand loop with dstrain's changes, phase by phase.
set -u
W=/tmp/wbf16; mkdir -p $W
SHAPE="--n-layer 16 --d-model 2048 --n-head 16 --vocab-size 50304 --seq-len 2048 --micro-batch 4"
S="python3 benchmarks/suite.py --work $W --gpus 1 $SHAPE"
( OPS="FusedAdamBuilder CPUAdamBuilder" bash benchmarks/gpu_ops.sh
  python3 -c "from dstrain.rank.adam_nogil import load_adam_without_gil as f; f(); print('op dstrain_cpu_adam_nogil: ready')"
) > $OUT/ops.log 2>&1 &
OPSPID=$!
$S --out $OUT/torch --runners torch --presets stage2 --steps 30 --row-timeout 120 > $OUT/torch.log 2>&1
wait $OPSPID
PYTHONPATH=$PYTHONPATH:$PWD/.whl/pytest-site timeout 200 python3 -m pytest -p no:cacheprovider -q \
  tests/test_offload_syncs.py -k "on_a_gpu" > $OUT/gputest.log 2>&1
OFF="+env:DSTRAIN_OFFLOAD_GRADS=off"
$S --out $OUT/rows --runners dstrain --presets stage2_offload --steps 20 --no-base --row-timeout 150 \
  --variant "bf16a@dstrain=train.log_every=5" --variant "fp32a@dstrain=train.log_every=5;$OFF" \
  --variant "bf16b@dstrain=train.log_every=5" --variant "fp32b@dstrain=train.log_every=5;$OFF" > $OUT/rows.log 2>&1
$S --out $OUT/phases --runners deepspeed --presets stage2_offload --steps 20 --no-base --row-timeout 150 \
  --variant "ph@deepspeed=+dstrain_offload;+phases" > $OUT/phases.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
for f in ops gputest torch rows phases; do echo "== $f"; grep -E "^(torch|dstrain|deepspeed) +(stage|none)|phases|ops ready|FAILED|passed|failed|Error" $OUT/$f.log | grep -v "  -  "; done
grep -h "CPU offload, dstrain" $W/dstrain-*.log | sort | uniq -c

# Follow-up on the same warm machine (results in followup/): the hand loop phase by phase with bf16
# gradients (on) and with DSTRAIN_OFFLOAD_GRADS=off, alternating:
#   W=/tmp/wbf16; S="python3 benchmarks/suite.py --work $W --gpus 1 $SHAPE"
#   $S --out $OUT/phases2 --runners deepspeed --presets stage2_offload --steps 20 --no-base --row-timeout 100 \
#     --variant "off@deepspeed=+dstrain_offload;+phases;+env:DSTRAIN_OFFLOAD_GRADS=off" \
#     --variant "on@deepspeed=+dstrain_offload;+phases" \
#     --variant "off2@deepspeed=+dstrain_offload;+phases;+env:DSTRAIN_OFFLOAD_GRADS=off" \
#     --variant "on2@deepspeed=+dstrain_offload;+phases" > $OUT/phases2.log 2>&1
