#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`: dstrain's stage3 with
# DeepCompile (its one-GPU default) through a whole run: training, evaluation every 10 steps (under
# no_grad, with the flash/efficient/math attention kernels), checkpoints at steps 10, 20 and 30; then a
# second run resumed from the first run's step-20 checkpoint to step 30 (its losses at steps 25 and 30
# against the first run's); then torch on the same 406M GPT for the ratio.
set -u
W=/tmp/w20; mkdir -p $W
OPS="FusedAdamBuilder DeepCompileBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1
SHAPE="--set model.n_layer=24 --set model.d_model=1024 --set model.n_head=16 --set model.vocab_size=100352 --set data.seq_len=1024 --set train.micro_batch_size=8"
RUN="python3 -m dstrain.cli run --preset stage3 --gpus 1 $SHAPE --set train.log_every=5 --set train.eval_every=10 --set train.save_every=10 --set train.keep_last=3 --set train.eval_batches=2"
$RUN --set train.max_steps=30 --run-dir $W/straight > $OUT/straight.log 2>&1; echo "straight exit $?" >> $OUT/straight.log
$RUN --set train.max_steps=30 --run-dir $W/resumed --resume $W/straight/checkpoints/step00000020 > $OUT/resumed.log 2>&1; echo "resumed exit $?" >> $OUT/resumed.log
cp $W/straight/metrics.jsonl $OUT/straight.metrics.jsonl; cp $W/resumed/metrics.jsonl $OUT/resumed.metrics.jsonl
S="python3 benchmarks/suite.py --work $W/suite --gpus 1 --presets stage3 --steps 40 --row-timeout 120 --out $OUT/m406"
$S --runners torch > $OUT/torch.log 2>&1
for f in ops straight resumed torch; do echo "== $f"; grep -E "^(torch|dstrain) +(stage|none)|ops ready|FAILED|step +[0-9]+/|eval loss|exit|resumed|summary|Error|error" $OUT/$f.log | cut -c1-200 | head -20; done
