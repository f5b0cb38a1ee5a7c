#!/bin/bash
# One nvidia-h100-x1 device call (issues 17 and 13), 406M GPT, 1 GPU, after `source benchmarks/gpu_env.sh`
# and `source benchmarks/gpu_extras.sh` (tensorboard for the log-cost rows).
# 1. What logging costs: --log-cost (log every step to metrics.jsonl + tensorboard + csv vs log nothing
#    in between), and the usual cadence (every 5 steps) with and without trackers.
# 2. Offload: stage2_offload and stage3_offload as shipped, against DeepSpeed's ZenFlow (stage 2:
#    important gradient columns updated on the GPU, the rest deferred to an overlapped CPU step) and
#    partial optimizer offload (stage 3: offload_optimizer.ratio), and grad accumulation 4 and 16.
set -u
W=/tmp/w; mkdir -p $W
Z=deepspeed.zero_optimization
S="python3 benchmarks/suite.py --work $W --row-timeout 150 --gpus 1"
# PART=1: ops, the torch row and the log-cost rows; PART=2 (the next call, machine still warm): offload.
OPS="FusedAdamBuilder CPUAdamBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1 &
OPSPID=$!
[ "${PART:-1}" = 1 ] && $S --out $OUT --runners torch --presets stage1 --steps 60 > $OUT/torch.log 2>&1
wait $OPSPID
if [ "${PART:-1}" = 1 ]; then
  $S --out $OUT --runners dstrain --presets stage2 --steps 120 --no-base --log-cost > $OUT/logcost.log 2>&1
else
  $S --out $OUT --runners dstrain --presets stage2_offload --steps 30 \
    --variant "zenflow@dstrain=$Z.zenflow.topk_ratio=0.05;$Z.zenflow.overlap_step=true;$Z.zenflow.update_interval=4" \
    --variant "ga16@dstrain=train.grad_accum_steps=16;train.log_every=1;train.max_steps=8" > $OUT/offload.log 2>&1
  $S --out $OUT --runners dstrain --presets stage3_offload --steps 30 \
    --variant "ratio50@dstrain=$Z.offload_optimizer.ratio=0.5" >> $OUT/offload.log 2>&1
fi
for f in ops torch logcost offload; do [ -f $OUT/$f.log ] || continue; echo "== $f"; grep -v "^    |" $OUT/$f.log | tail -n 22; done
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
