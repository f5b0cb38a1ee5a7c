#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`: why DeepCompile ran
# ZeRO-3 at 1,176 tokens/s (finding 12). The hand loop with dstrain's stage3 JSON, DeepCompile on
# (deepspeed.compile.deepcompile with train.compile), each step its own interval, torch's recompile and
# graph-break logs on, cProfile of rank 0 over 6 more steps; then the same with DeepSpeed's defaults
# (no whole blocks, no persistence rule); then eager stage3 and torch for the ratios. 406M GPT.
set -u
W=/tmp/w17; mkdir -p $W
OPS="FusedAdamBuilder DeepCompileBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1
S="python3 benchmarks/suite.py --work $W --gpus 1 --presets stage3 --log-every 1 --warmup 8 --no-base --runners deepspeed"
DC="deepspeed.compile.deepcompile=true;train.compile=true;+env:TORCH_LOGS=recompiles,graph_breaks"
PLAIN="deepspeed.zero_optimization.stage3_module_granularity_threshold=0;deepspeed.zero_optimization.stage3_param_persistence_threshold=100000;deepspeed.zero_optimization.memory_efficient_linear=true"
$S --steps 14 --row-timeout 300 --out $OUT/dc --variant "dc@deepspeed=$DC;+pyprofile" > $OUT/dc.log 2>&1
$S --steps 14 --row-timeout 150 --out $OUT/dc --variant "dcplain@deepspeed=$DC;$PLAIN" > $OUT/dcplain.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
for f in ops dc dcplain; do echo "== $f"; grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)|ops ready|FAILED" $OUT/$f.log | grep -v "  -  "; done
for f in $W/*.log; do echo "== $f"; grep -E "interval to step|Recompil|Graph break|Launching compile|Error|error" $f | head -40; done
