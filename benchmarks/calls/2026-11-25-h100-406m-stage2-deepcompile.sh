#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`: does DeepSpeed's DeepCompile
# for ZeRO-1/2 (its reduction compiled into the graph, no per-gradient hooks) close the gap between compiled
# stage 1/2 and compiled torch on the 406M GPT (finding 38: 1.00 against 1.34 of eager torch)? 100-step
# rows: torch eager and compiled; dstrain stage2 as shipped (torch.compile); stage2 with
# deepspeed.compile.deepcompile=true, twice (the second with inductor's cache warm); stage1 with it.
set -u
W=/tmp/w406dc; mkdir -p $W
S="python3 benchmarks/suite.py --work $W --gpus 1 --steps 100 --row-timeout 170 --out $OUT/m406"
DC="deepspeed.compile.deepcompile=true"
( OPS="FusedAdamBuilder DeepCompileBuilder" bash benchmarks/gpu_ops.sh ) > $OUT/ops.log 2>&1 &
OPSPID=$!
$S --runners torch --presets stage2 --variant "compiled@torch=+compile" > $OUT/torch.log 2>&1
wait $OPSPID
$S --runners dstrain --presets stage2 --variant "dc@dstrain=$DC" --variant "dc_again@dstrain=$DC" > $OUT/rows.log 2>&1
$S --runners dstrain --presets stage1 --no-base --variant "dc@dstrain=$DC" > $OUT/rows1.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
for f in ops torch rows rows1; do echo "== $f"
  grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)|ready|FAILED" $OUT/$f.log | grep -v "  -  "; done
grep -h -i "error\|Traceback" $W/dstrain-*dc*.log | head -8
