#!/bin/bash
# One nvidia-h200-x2 call: the 1.1B Llama ZeRO-3 fine-tune on one and two H200s with decoder layers
# fetched whole (the default for hf: models since this session's earlier H100 call); Lightning's rows
# for the same machine kind are in benchmarks/results/2026-11-23-h200x2-finetune.json.
set -u
OPS="FusedAdamBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1
python3 benchmarks/finetune.py --gpus 1,2 --no-lightning --no-load --json $OUT/finetune-leaf.json > $OUT/finetune-leaf.log 2>&1
cat $OUT/ops.log; grep "^row" $OUT/finetune-leaf.log; tail -5 $OUT/finetune-leaf.log
