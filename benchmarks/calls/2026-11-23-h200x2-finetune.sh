#!/bin/bash
# One nvidia-h200-x2 device call (issue 14): fine-tuning a 1.1B Llama-style model (random weights saved
# locally) with ZeRO-3 through dstrain on 1 and 2 GPUs, Lightning's DeepSpeedStrategy(stage=3) as the peer,
# and the host RAM of loading. After `source benchmarks/gpu_env.sh`, from the project root.
set -u
OPS="FusedAdamBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1
python3 benchmarks/finetune.py --gpus 1,2 --json $OUT/finetune.json > $OUT/finetune.log 2>&1
cat $OUT/ops.log; tail -n 40 $OUT/finetune.log
