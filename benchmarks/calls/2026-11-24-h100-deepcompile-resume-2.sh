#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`: dstrain's stage3 with
# DeepCompile, evaluation now through the model's own forward with every parameter gathered (a no_grad
# pass through DeepCompile's graph broke the next backward). A whole run on the 406M GPT: evaluations
# and checkpoints at steps 10 and 20; then a second run resumed from its step-10 checkpoint to step
# 20, whose losses at steps 15 and 20 should match the first run's. DeepCompile's schedule now starts at
# the step the run starts at (DeepSpeed's starts at step 0, which a resumed run never sees).
set -u
W=/tmp/w23; mkdir -p $W
OPS="FusedAdamBuilder DeepCompileBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1
SHAPE="--set model.n_layer=24 --set model.d_model=1024 --set model.n_head=16 --set model.vocab_size=100352 --set data.seq_len=1024 --set train.micro_batch_size=8"
RUN="python3 -m dstrain.cli run --preset stage3 --gpus 1 $SHAPE --set train.log_every=5 --set train.eval_every=10 --set train.save_every=10 --set train.keep_last=3 --set train.eval_batches=2 --set train.max_steps=20"
timeout 300 $RUN --run-dir $W/straight > $OUT/straight.log 2>&1; echo "straight exit $?" >> $OUT/straight.log
timeout 200 $RUN --run-dir $W/resumed --resume $W/straight/checkpoints/step00000010 > $OUT/resumed.log 2>&1; echo "resumed exit $?" >> $OUT/resumed.log
cp $W/straight/metrics.jsonl $OUT/straight.metrics.jsonl; cp $W/resumed/metrics.jsonl $OUT/resumed.metrics.jsonl
for f in ops straight resumed; do echo "== $f"; grep -E "ops ready|FAILED|step +[0-9]+/|eval loss|exit|saved|resumed|summary|ready in|Error|error|Assertion" $OUT/$f.log | cut -c1-220 | head -20; done
