#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`: the 1.3B GPT (24 x 2048,
# 16 heads, vocabulary 50,304, sequence 1024, micro batch 8) on one machine as of this session's tree:
# torch eager; dstrain stage2 and stage3; stage3's hand loop (dstrain's stage3 JSON) and Lightning's
# deepspeed_stage_3.
set -u
W=/tmp/w13s; mkdir -p $W
SHAPE="--n-layer 24 --d-model 2048 --n-head 16 --vocab-size 50304"
S="python3 benchmarks/suite.py --work $W --gpus 1 $SHAPE --steps 30 --row-timeout 150 --out $OUT/b13"
OPS="FusedAdamBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1 &
OPSPID=$!
$S --runners torch --presets stage2 > $OUT/torch.log 2>&1
wait $OPSPID
$S --runners dstrain --presets stage2,stage3 > $OUT/dstrain.log 2>&1
$S --runners deepspeed,lightning --presets stage3 > $OUT/peers.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
for f in ops torch dstrain peers; do echo "== $f"; grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)|ready|FAILED" $OUT/$f.log | grep -v "  -  "; done
