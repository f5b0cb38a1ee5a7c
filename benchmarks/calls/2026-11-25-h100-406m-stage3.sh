#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`: dstrain's stage3 on the
# 406M GPT in 100-step rows (the matrix's 30-step row read 0.68 of torch, spread 23%): as shipped
# (blocks whole, the token embedding and its tied head sharded), every parameter persistent (on one GPU
# the shard is the whole model, so it costs no memory; the embedding's and head's module hooks then go
# too), and DeepSpeed's step and hooks (DSTRAIN_ZERO3_STEP=off); torch eager first and last.
set -u
W=/tmp/w406s3; mkdir -p $W
S="python3 benchmarks/suite.py --work $W --gpus 1 --steps 100 --row-timeout 150"
ALL="deepspeed.zero_optimization.stage3_param_persistence_threshold=1000000000;deepspeed.zero_optimization.memory_efficient_linear=false"
( OPS="FusedAdamBuilder" bash benchmarks/gpu_ops.sh ) > $OUT/ops.log 2>&1 &
OPSPID=$!
$S --out $OUT/m406 --runners torch --presets stage2 > $OUT/torch.log 2>&1
wait $OPSPID
$S --out $OUT/m406 --runners dstrain --presets stage3 --no-base --variant "shipped@dstrain=" \
  --variant "allpersist@dstrain=$ALL" --variant "off@dstrain=+env:DSTRAIN_ZERO3_STEP=off" > $OUT/rows.log 2>&1
$S --out $OUT/again --runners dstrain --presets stage3 --no-base --variant "allpersist@dstrain=$ALL" \
  --variant "shipped@dstrain=" > $OUT/rows2.log 2>&1
$S --out $OUT/again --runners torch --presets stage2 > $OUT/torch2.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
grep -h "ZeRO-3" $W/*.log | sed 's/^\[ *[0-9.]*s\] //' | sort | uniq -c | head -6
for f in ops torch rows rows2 torch2; do echo "== $f"
  grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)|ready|FAILED" $OUT/$f.log | grep -v "  -  "; done
