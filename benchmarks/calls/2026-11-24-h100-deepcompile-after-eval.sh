#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`: the DeepCompile run of
# 2026-11-24-h100-deepcompile-resume aborted at step 11, after step 10's evaluation and checkpoint
# (DeepCompile's reduce bucket assertion). Which of the two: dstrain's stage3 with DeepCompile on the
# 406M GPT, first with evaluations at steps 10 and 20 and no checkpoint, then with checkpoints at
# steps 10 and 20 and no evaluation before the end.
set -u
W=/tmp/w21; mkdir -p $W
OPS="FusedAdamBuilder DeepCompileBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1
SHAPE="--set model.n_layer=24 --set model.d_model=1024 --set model.n_head=16 --set model.vocab_size=100352 --set data.seq_len=1024 --set train.micro_batch_size=8"
RUN="python3 -m dstrain.cli run --preset stage3 --gpus 1 $SHAPE --set train.log_every=5 --set train.max_steps=20 --set train.eval_batches=2"
timeout 300 $RUN --set train.eval_every=10 --set train.save_checkpoints=false --run-dir $W/evals > $OUT/evals.log 2>&1; echo "evals exit $?" >> $OUT/evals.log
timeout 200 $RUN --set train.eval_every=1000 --set train.save_every=10 --run-dir $W/saves > $OUT/saves.log 2>&1; echo "saves exit $?" >> $OUT/saves.log
for f in ops evals saves; do echo "== $f"; grep -E "ops ready|FAILED|step +[0-9]+/|eval loss|exit|saved|summary|Error|error|Assertion" $OUT/$f.log | cut -c1-220 | head -20; done
