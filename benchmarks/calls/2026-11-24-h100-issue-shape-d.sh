#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`, on the issue's 913M shape
# (16 x 2048, 16 heads, vocabulary 50,304, sequence 2048, micro batch 4): how grad accumulation 4 and 16
# amortise the offload presets' CPU step (accumulation 1 is in 2026-11-24-h100-issue-shape/part2), with
# a torch row on the same machine; then dstrain stage2 eager (train.compile=false) twice, for its command
# to first step (the second run with warm caches).
set -u
W=/tmp/wshaped; mkdir -p $W
SHAPE="--n-layer 16 --d-model 2048 --n-head 16 --vocab-size 50304 --seq-len 2048 --micro-batch 4"
S="python3 benchmarks/suite.py --work $W --gpus 1 $SHAPE"
( OPS="FusedAdamBuilder CPUAdamBuilder" bash benchmarks/gpu_ops.sh
  python3 -c "from dstrain.rank.adam_nogil import load_adam_without_gil as f; f(); print('op dstrain_cpu_adam_nogil: ready')"
) > $OUT/ops.log 2>&1 &
OPSPID=$!
$S --out $OUT/torch --runners torch --presets stage2 --steps 40 --row-timeout 120 > $OUT/torch.log 2>&1
wait $OPSPID
$S --out $OUT/ga --runners dstrain --presets stage2_offload,stage3_offload --steps 30 --no-base --row-timeout 120 \
  --variant "ga4@dstrain=train.grad_accum_steps=4;train.log_every=1;train.max_steps=12" \
  --variant "ga16@dstrain=train.grad_accum_steps=16;train.log_every=1;train.max_steps=8" > $OUT/ga.log 2>&1
$S --out $OUT/eager --runners dstrain --presets stage2 --steps 20 --no-base --row-timeout 90 \
  --variant "eager@dstrain=train.compile=false" --variant "eager2@dstrain=train.compile=false" > $OUT/eager.log 2>&1
for f in ops torch ga eager; do echo "== $f"; grep -v "^    |" $OUT/$f.log | tail -n 6; done
grep -H "ready in" $W/dstrain-*.log
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
