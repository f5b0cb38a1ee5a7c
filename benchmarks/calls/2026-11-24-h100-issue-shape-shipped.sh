#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`: every preset dstrain
# ships on one GPU (stage3_nvme aside: disk-bound, finding 31) on the 913M shape (16 x 2048, 16
# heads, vocabulary 50,304, sequence 2048, micro batch 4), as of this session's tree, one machine: torch
# eager; dstrain stage1, stage2, stage3, stage2_offload, stage3_offload; stage3's hand loop (DeepSpeed as
# its documentation writes it, with dstrain's stage3 JSON) and Lightning's deepspeed_stage_3.
set -u
W=/tmp/wshipped; mkdir -p $W
SHAPE="--n-layer 16 --d-model 2048 --n-head 16 --vocab-size 50304 --seq-len 2048 --micro-batch 4"
S="python3 benchmarks/suite.py --work $W --gpus 1 $SHAPE --steps 30 --row-timeout 150 --out $OUT/m913"
( OPS="FusedAdamBuilder CPUAdamBuilder" bash benchmarks/gpu_ops.sh
  python3 -c "from dstrain.rank.adam_nogil import load_adam_without_gil as f; f(); print('op dstrain_cpu_adam_nogil: ready')"
) > $OUT/ops.log 2>&1 &
OPSPID=$!
$S --runners torch --presets stage2 > $OUT/torch.log 2>&1
wait $OPSPID
$S --runners dstrain --presets stage1,stage2,stage3,stage2_offload,stage3_offload > $OUT/dstrain.log 2>&1
$S --runners deepspeed,lightning --presets stage3 > $OUT/peers.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
grep -h "ZeRO-3\|CPU offload" $W/*.log | sed 's/^\[ *[0-9.]*s\] //' | sort | uniq -c | head -6
for f in ops torch dstrain peers; do echo "== $f"; grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)|ready|FAILED" $OUT/$f.log | grep -v "  -  "; done
