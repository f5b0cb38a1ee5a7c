#!/bin/bash
# One device call on nvidia-h200-x2 (issue 13), run from the project root after `source benchmarks/gpu_env.sh`.
# Phase 1 while DeepSpeed's ops build: the torch rows (GPU-bound, not disturbed by the build).
# Phase 2, in parallel: GPU 0 runs the one-GPU lightning/dstrain rows (dstrain's launcher always takes
# GPU 0: DeepSpeed's runner ignores CUDA_VISIBLE_DEVICES once --num_gpus is given), GPU 1 the
# offload rows of the hand loop through torchrun (which honours CUDA_VISIBLE_DEVICES); each suite
# writes its own results folder. Phase 3: two-GPU stage 3.
set -u
W=/tmp/w; mkdir -p $W $OUT/a $OUT/b
Z=deepspeed.zero_optimization
S="python3 benchmarks/suite.py --work $W --row-timeout 130 --steps 40"
OPS="FusedAdamBuilder CPUAdamBuilder" bash benchmarks/gpu_ops.sh > $OUT/p1.log 2>&1 &
OPSPID=$!
$S --out $OUT --gpus 1,2 --runners torch --presets stage1 > $OUT/p1-torch.log 2>&1
wait $OPSPID; cat $OUT/p1-torch.log >> $OUT/p1.log; rm $OUT/p1-torch.log
$S --out $OUT/a --gpus 1 --runners lightning,dstrain --presets stage3,stage2 > $OUT/a.log 2>&1 &
A=$!
( export CUDA_VISIBLE_DEVICES=1 OMP_NUM_THREADS=16
  $S --out $OUT/b --gpus 1 --runners deepspeed --presets stage2_offload,stage3_offload
  $S --out $OUT/b --gpus 1 --runners deepspeed --presets stage3_offload --no-base \
    --variant "noac@deepspeed=train.activation_checkpointing=false"
  $S --out $OUT/b --gpus 1 --runners deepspeed --presets stage2_offload --no-base \
    --variant "ga4@deepspeed=train.grad_accum_steps=4;train.log_every=4;train.max_steps=48" ) > $OUT/b.log 2>&1 &
B=$!
wait $A $B
$S --out $OUT --gpus 2 --runners deepspeed,dstrain,lightning --presets stage3 \
  --variant "noleaf@deepspeed=$Z.leaf_module.classes=[]" > $OUT/p3.log 2>&1
for f in p1 a b p3; do echo "== $f"; grep -v "^    |" $OUT/$f.log | tail -n 25; done
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
