#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`: the 406M one-GPU rows
# again with this session's tree (ZeRO-3's lean backward, the stream lookup on every CUDA preset): torch;
# dstrain's five presets without NVMe; stage3's hand loop and Lightning peer; torch again. 60 steps a row
# (offload 30). Results JSON in one archive.
set -u
W=/tmp/w9; mkdir -p $W
S="python3 benchmarks/suite.py --work $W --gpus 1 --row-timeout 200 --out $W/res/m406"
( OPS="FusedAdamBuilder CPUAdamBuilder" bash benchmarks/gpu_ops.sh
  python3 -c "from dstrain.rank.adam_nogil import load_adam_without_gil as f; f(); print('op dstrain_cpu_adam_nogil: ready')"
) > $OUT/ops.log 2>&1 &
OPSPID=$!
$S --steps 60 --runners torch --presets stage2 > $OUT/torch.log 2>&1
wait $OPSPID
$S --steps 60 --runners dstrain --presets stage1,stage2,stage3,stage2_offload,stage3_offload > $OUT/rows.log 2>&1
$S --steps 60 --runners deepspeed,lightning --presets stage3 > $OUT/peers.log 2>&1
$S --steps 60 --runners torch --presets stage2 > $OUT/torch2.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) res 2>/dev/null
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
grep -h "ZeRO-3\|CPU offload" $W/*.log 2>/dev/null | sed 's/^\[ *[0-9.]*s\] //' | sort | uniq -c | head -6
for f in ops torch rows peers torch2; do echo "== $f"
  grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)|FAILED" $OUT/$f.log | grep -v "  -  "; done
