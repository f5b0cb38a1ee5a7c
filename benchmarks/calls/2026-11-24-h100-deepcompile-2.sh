#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`: DeepCompile on the
# 406M GPT with DeepSpeed's own ZeRO-3 settings (dstrain's whole blocks break it: its leaf module keeps a
# module backward hook, which torch.compile cannot trace without compiled autograd). The hand loop,
# each step its own interval: DeepCompile's default schedule (gather/release from step 0, the profiled
# prefetch and selective-gather passes from step 5) for 40 steps, then its gather/release pass alone.
# As run (tree d5c4a37) the flags were "+dc_z3_only" on the second row and none on the first;
# the suite now mirrors dstrain (gather/release alone on one GPU), so the first row names +dc_full_schedule.
set -u
W=/tmp/w18; mkdir -p $W
OPS="FusedAdamBuilder DeepCompileBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1
S="python3 benchmarks/suite.py --work $W --gpus 1 --presets stage3 --log-every 1 --warmup 12 --no-base --runners deepspeed"
DC="deepspeed.compile.deepcompile=true;train.compile=true;+env:TORCH_LOGS=recompiles,graph_breaks"
PLAIN="deepspeed.zero_optimization.stage3_module_granularity_threshold=0;deepspeed.zero_optimization.stage3_param_persistence_threshold=100000;deepspeed.zero_optimization.memory_efficient_linear=true"
$S --steps 40 --row-timeout 290 --out $OUT/dc --variant "dcsched@deepspeed=$DC;$PLAIN;+dc_full_schedule" > $OUT/dcsched.log 2>&1
$S --steps 30 --row-timeout 200 --out $OUT/dc --variant "dcz3@deepspeed=$DC;$PLAIN" > $OUT/dcz3.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
for f in ops dcsched dcz3; do echo "== $f"; grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)|ops ready|FAILED" $OUT/$f.log | grep -v "  -  "; done
for f in $W/*.log; do echo "== $f"; grep -E "interval to step|Recompil|Graph break|Launching compile|Error|error" $f | head -50; done
