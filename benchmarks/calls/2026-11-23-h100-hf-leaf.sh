#!/bin/bash
# One nvidia-h100-x1 call: ZeRO-3 fine-tuning of the 1.1B Llama on one GPU with each decoder layer
# fetched whole (dstrain's new default for hf: models) against DeepSpeed's per-module fetching.
set -u
OPS="FusedAdamBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1
PYTHONPATH=benchmarks:$PYTHONPATH python3 -c "from hf_load_memory import make; from pathlib import Path; make(Path('/tmp/llama1b'), None)" > $OUT/make.log 2>&1
F="python3 benchmarks/finetune.py --gpus 1 --no-lightning --no-load --model-dir /tmp/llama1b"
$F --json $OUT/leaf.json > $OUT/leaf.log 2>&1
$F --set deepspeed.zero_optimization.stage3_module_granularity_threshold=0 --json $OUT/noleaf.json > $OUT/noleaf.log 2>&1
cat $OUT/ops.log; grep "^row" $OUT/leaf.log $OUT/noleaf.log
