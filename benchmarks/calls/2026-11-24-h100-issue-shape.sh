#!/bin/bash
# nvidia-h100-x1 device calls (issue 13), after `source benchmarks/gpu_env.sh`: every preset on the issue's
# own shape (dstrain's GPT, 16 layers x 2048 wide, 16 heads, vocabulary 50,304, sequence 2048, micro
# batch 4: 913M parameters), with the torch, lightning, deepspeed (hand loop) and dstrain rows, on the
# tree as it is now: what the table (stage3 0.43, stage2_offload 0.21 of torch eager) reads today.
# PART=1: the ops build while the torch rows run (eager and compiled); then stage2, stage3, stage1.
# PART=2 (same machine, ops built): stage2_offload, stage3_offload, then dstrain's stage3_nvme.
set -u
W=/tmp/wshape; mkdir -p $W
SHAPE="--n-layer 16 --d-model 2048 --n-head 16 --vocab-size 50304 --seq-len 2048 --micro-batch 4"
S="python3 benchmarks/suite.py --work $W --gpus 1 $SHAPE --steps 40"
if [ "${PART:-1}" = 1 ]; then
  ( bash benchmarks/gpu_ops.sh
    python3 -c "from dstrain.rank.adam_nogil import load_adam_without_gil as f; f(); print('op dstrain_cpu_adam_nogil: ready')"
  ) > $OUT/ops.log 2>&1 &
  OPSPID=$!
  $S --out $OUT/torch --runners torch --presets stage2 --row-timeout 150 --variant "compiled@torch=+compile" > $OUT/torch.log 2>&1
  wait $OPSPID
  $S --out $OUT/p1 --runners lightning,deepspeed,dstrain --presets stage2,stage3,stage1 --row-timeout 110 > $OUT/p1.log 2>&1
  LOGS="ops torch p1"
else
  $S --out $OUT/p2 --runners dstrain,lightning,deepspeed --presets stage2_offload,stage3_offload --row-timeout 110 > $OUT/p2.log 2>&1
  $S --out $OUT/p2 --runners dstrain --presets stage3_nvme --row-timeout 150 > $OUT/nvme.log 2>&1
  LOGS="p2 nvme"
fi
for f in $LOGS; do echo "== $f"; grep -v "^    |" $OUT/$f.log | tail -n 30; done
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
# Same machine, the call after PART=2 (results in part3/; PART=1 ran out of time before stage1's hand-loop
# and dstrain rows): second runs of dstrain stage3 and stage2 (warm bytecode and compile caches), then stage1:
#   S="python3 benchmarks/suite.py --work /tmp/wshape --gpus 1 $SHAPE --steps 40"
#   $S --out $OUT/p3 --runners dstrain --presets stage3,stage2 --row-timeout 100 > $OUT/p3.log 2>&1
#   $S --out $OUT/p3 --runners dstrain,deepspeed --presets stage1 --row-timeout 100 >> $OUT/p3.log 2>&1
