#!/bin/bash
# One nvidia-h100-x1 device call (issue 13, after issue 12's layout): start-up with the per-node
# launcher started directly and the pre-launch count without torch._dynamo; each dstrain row twice
# (the second finds the page cache and torch's compile cache warm). 406M GPT, 1 GPU.
# After `source benchmarks/gpu_env.sh`, from the project root.
set -u
W=/tmp/w; mkdir -p $W
S="python3 benchmarks/suite.py --work $W --row-timeout 120 --steps 30 --gpus 1"
OPS="FusedAdamBuilder CPUAdamBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1 &
OPSPID=$!
for m in "import torch" "import deepspeed" "import dstrain.cli"; do
  /usr/bin/time -f "%e s  $m" python3 -c "$m" 2>&1 | tail -1; done > $OUT/imports.log
( cd /tmp && /usr/bin/time -f "%e s  dstrain run --preset stage3 --dry-run" python3 -m dstrain.cli run --preset stage3 --gpus 1 --dry-run >/dev/null ) 2>> $OUT/imports.log
$S --out $OUT/torch --runners torch --presets stage1 > $OUT/torch.log 2>&1
wait $OPSPID
for pass in 1 2; do
  $S --out $OUT/pass$pass --runners dstrain --presets stage2,stage3 --variant "eager@dstrain=train.compile=false" > $OUT/pass$pass.log 2>&1
done
for f in ops imports torch pass1 pass2; do echo "== $f"; grep -v "^    |" $OUT/$f.log | tail -n 14; done
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
