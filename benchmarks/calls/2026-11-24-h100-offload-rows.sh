#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`, on the issue's 913M shape:
# dstrain's offload presets as shipped after finding 35 (bf16 gradient copies), with torch on the same
# machine; stage2_offload with a smaller gradient bucket (reduce_bucket_size 5e7: a shorter last copy
# after the backward), dstrain and the hand loop's phases.
set -u
W=/tmp/wrows; mkdir -p $W
SHAPE="--n-layer 16 --d-model 2048 --n-head 16 --vocab-size 50304 --seq-len 2048 --micro-batch 4"
S="python3 benchmarks/suite.py --work $W --gpus 1 $SHAPE"
( OPS="FusedAdamBuilder CPUAdamBuilder" bash benchmarks/gpu_ops.sh
  python3 -c "from dstrain.rank.adam_nogil import load_adam_without_gil as f; f(); print('op dstrain_cpu_adam_nogil: ready')"
) > $OUT/ops.log 2>&1 &
OPSPID=$!
$S --out $OUT/torch --runners torch --presets stage2 --steps 30 --row-timeout 120 > $OUT/torch.log 2>&1
wait $OPSPID
B="deepspeed.zero_optimization.reduce_bucket_size=50000000"
$S --out $OUT/rows --runners dstrain,deepspeed --presets stage2_offload --steps 20 --no-base --row-timeout 100 \
  --variant "shipped@dstrain=train.log_every=5" --variant "bucket5e7@dstrain=train.log_every=5;$B" \
  --variant "shipped2@dstrain=train.log_every=5" \
  --variant "ph5e7@deepspeed=$B;+dstrain_offload;+phases" > $OUT/rows.log 2>&1
$S --out $OUT/rows3 --runners dstrain --presets stage3_offload --steps 20 --no-base --row-timeout 100 \
  --variant "shipped@dstrain=train.log_every=5" > $OUT/rows3.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
for f in ops torch rows rows3; do echo "== $f"; grep -E "^(torch|dstrain|deepspeed) +(stage|none)|phases|ops ready|FAILED|passed|failed|Error" $OUT/$f.log | grep -v "  -  "; done
grep -h "CPU offload, dstrain" $W/dstrain-*.log | sort | uniq -c
