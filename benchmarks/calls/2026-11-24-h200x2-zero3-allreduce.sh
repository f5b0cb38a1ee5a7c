#!/bin/bash
# One nvidia-h200-x2 device call (issue 13), after `source benchmarks/gpu_env.sh`: two-GPU ZeRO-3 against
# DDP on the 406M and the 1.3B GPT, dstrain's stage3 preset as is and with
# zero_optimization.stage3_use_all_reduce_for_fetch_params (one hand-loop row at 406M gave +32% on
# 2026-11-22; finding 15 asked for it to be confirmed before the preset takes it), alternating.
# The DDP rows run while DeepSpeed's ops build. Results go straight to $OUT.
set -u
W=/tmp/w7; mkdir -p $W
AR="ar@dstrain=deepspeed.zero_optimization.stage3_use_all_reduce_for_fetch_params=true"
BIG="--n-layer 24 --d-model 2048 --n-head 16 --vocab-size 50304"
S="python3 benchmarks/suite.py --work $W --row-timeout 150 --gpus 2"
OPS="FusedAdamBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1 &
OPSPID=$!
$S --steps 60 --out $OUT/m406 --runners torch --presets stage3 > $OUT/ddp406.log 2>&1
$S --steps 30 $BIG --out $OUT/b13 --runners torch --presets stage3 > $OUT/ddp13.log 2>&1
wait $OPSPID
$S --steps 60 --out $OUT/m406 --runners dstrain --presets stage3 --variant "$AR" --variant "again@dstrain=" \
  --variant "${AR/ar@/ar2@}" > $OUT/z406.log 2>&1
$S --steps 30 $BIG --out $OUT/b13 --runners dstrain --presets stage3 --variant "$AR" > $OUT/z13.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
for f in ops ddp406 ddp13 z406 z13; do echo "== $f"; grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)|ops ready|FAILED" $OUT/$f.log | grep -v "  -  "; done
