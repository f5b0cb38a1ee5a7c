#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`: ZeRO-3 with each
# transformer block's forward compiled (train.compile=true now compiles the ZeRO-3 leaf modules, not the
# whole model, so DeepSpeed's gather/reduce hooks stay outside the graph), against the eager preset, in
# alternating 100-step rows on the 406M GPT; then the 1.3B GPT and stage3_offload at 406M; torch eager
# first (and at 1.3B).
set -u
W=/tmp/w3c; mkdir -p $W
S="python3 benchmarks/suite.py --work $W --gpus 1 --row-timeout 200"
B13="--n-layer 24 --d-model 2048 --vocab-size 50304"
( OPS="FusedAdamBuilder CPUAdamBuilder" bash benchmarks/gpu_ops.sh
  python3 -c "from dstrain.rank.adam_nogil import load_adam_without_gil as f; f(); print('op dstrain_cpu_adam_nogil: ready')"
) > $OUT/ops.log 2>&1 &
OPSPID=$!
$S --steps 60 --out $OUT/m406 --runners torch --presets stage2 > $OUT/torch.log 2>&1
wait $OPSPID
$S --steps 100 --out $OUT/m406 --runners dstrain --presets stage3 --no-base --variant "eager@dstrain=" \
  --variant "blocks@dstrain=train.compile=true" --variant "eager2@dstrain=" \
  --variant "blocks2@dstrain=train.compile=true" > $OUT/rows406.log 2>&1
$S --steps 60 --out $OUT/b13 $B13 --runners dstrain --presets stage3 --no-base --variant "eager@dstrain=" \
  --variant "blocks@dstrain=train.compile=true" > $OUT/rows13.log 2>&1
$S --steps 60 --out $OUT/b13 $B13 --runners torch --presets stage2 > $OUT/torch13.log 2>&1
$S --steps 20 --out $OUT/off406 --runners dstrain --presets stage3_offload --no-base --variant "eager@dstrain=" \
  --variant "blocks@dstrain=train.compile=true" > $OUT/rowsoff.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
for f in ops torch rows406 rows13 torch13 rowsoff; do echo "== $f"
  grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)|FAILED|Error" $OUT/$f.log | grep -v "  -  " | head -12; done
