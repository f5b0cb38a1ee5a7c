#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`: the hand loop's
# stage3_nvme on the 1.3B GPT (dstrain's JSON, stage3_max_reuse_distance 0), the row the confirming call
# cut off at its 200 s row limit. Results go straight to $OUT.
set -u
W=/tmp/w6; mkdir -p $W
OPS="FusedAdamBuilder CPUAdamBuilder AsyncIOBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1
BIG="--n-layer 24 --d-model 2048 --n-head 16 --vocab-size 50304 --steps 30"
python3 benchmarks/suite.py --work $W --row-timeout 400 --gpus 1 $BIG --out $OUT/nvme --runners deepspeed \
  --presets stage3_nvme > $OUT/nvme.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
for f in ops nvme; do echo "== $f"; grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)|ops ready|FAILED" $OUT/$f.log | grep -v "  -  "; done
