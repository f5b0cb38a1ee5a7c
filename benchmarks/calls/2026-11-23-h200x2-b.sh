#!/bin/bash
# Second nvidia-h200-x2 call (issue 13): where `dstrain run`'s start-up goes on a GPU machine, stage-3
# fetch settings on two GPUs (406M), and the 1.3B shape on two GPUs. After `source benchmarks/gpu_env.sh`.
set -u
W=/tmp/w; mkdir -p $W
Z=deepspeed.zero_optimization
OPS="FusedAdamBuilder CPUAdamBuilder" bash benchmarks/gpu_ops.sh > $OUT/b1.log 2>&1 &
OPSPID=$!
# start-up: imports of each process in the chain, on this machine (no GPU work)
for m in "import torch" "import deepspeed" "import deepspeed.launcher.runner" "import dstrain.cli"; do
  /usr/bin/time -f "%e s  $m" python3 -c "$m" 2>&1 | tail -1; done >> $OUT/b1.log
( cd /tmp && python3 -X importtime -m dstrain.cli run --preset stage3 --gpus 1 --dry-run 2> $W/importtime.txt | tail -1
  sort -t'|' -k2 -n -r $W/importtime.txt | head -15 ) >> $OUT/b1.log 2>&1
BIG="--n-layer 24 --d-model 2048 --n-head 16 --vocab-size 50304 --steps 30"
python3 benchmarks/suite.py --out $OUT/big --work $W --row-timeout 100 --gpus 2 --runners torch --presets stage1 $BIG >> $OUT/b1.log 2>&1
wait $OPSPID
python3 benchmarks/suite.py --out $OUT/big --work $W --row-timeout 100 --gpus 2 --runners dstrain --presets stage3,stage2 $BIG >> $OUT/b1.log 2>&1
python3 benchmarks/suite.py --out $OUT --work $W --row-timeout 90 --steps 40 --gpus 2 --runners deepspeed --presets stage3 --no-base \
  --variant "big@deepspeed=$Z.stage3_prefetch_bucket_size=200000000;$Z.reduce_bucket_size=200000000;$Z.stage3_param_persistence_threshold=10000000" \
  --variant "allreduce@deepspeed=$Z.stage3_use_all_reduce_for_fetch_params=true" >> $OUT/b1.log 2>&1
grep -v "^    |" $OUT/b1.log
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
