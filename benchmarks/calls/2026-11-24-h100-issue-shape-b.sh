#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`, on the issue's 913M shape
# (16 x 2048, 16 heads, vocabulary 50,304, sequence 2048, micro batch 4):
# 1. where stage3's 8.7 s of "model and engine" go: a 2-step run writes the resolved config, then
#    benchmarks/engine_build_profile.py times the model build and deepspeed.initialize under cProfile
#    (stage3, and stage2 eager beside it);
# 2. dstrain stage3 with DeepCompile (on by default only from 5,000 passes), 60 steps.
set -u
W=/tmp/wshapeb; mkdir -p $W
SETS="--set model.n_layer=16 --set model.d_model=2048 --set model.n_head=16 --set model.vocab_size=50304 --set data.seq_len=2048 --set train.micro_batch_size=4 --set data.source=synthetic"
OPS="FusedAdamBuilder DeepCompileBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1
for p in stage3 stage2; do
  python3 -m dstrain.cli run --preset $p --gpus 1 --run-dir $W/$p $SETS --set train.max_steps=2 --set train.compile=false > $OUT/run-$p.log 2>&1
  python3 benchmarks/engine_build_profile.py $W/$p --top 45 > $OUT/profile-$p.log 2>&1
done
SHAPE="--n-layer 16 --d-model 2048 --n-head 16 --vocab-size 50304 --seq-len 2048 --micro-batch 4"
python3 benchmarks/suite.py --work $W --gpus 1 $SHAPE --steps 60 --presets stage3 --no-base --runners dstrain --row-timeout 300 \
  --out $OUT/dc --variant "dc@dstrain=deepspeed.compile.deepcompile=true" > $OUT/dc.log 2>&1
grep -E "ops ready|FAILED" $OUT/ops.log; grep -h "ready in" $OUT/run-*.log; head -1 $OUT/profile-*.log
grep -v "^    |" $OUT/dc.log | tail -n 4
