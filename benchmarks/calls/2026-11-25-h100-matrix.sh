#!/bin/bash
# Four nvidia-h100-x1 device calls (issue 13), after `source benchmarks/gpu_env.sh`, held warm between
# them: the "checked by" matrix on one GPU as of this tree, every preset with every runner (torch
# eager; dstrain; the hand loop, DeepSpeed as its documentation writes it with dstrain's JSON; Lightning's
# deepspeed_stage_* strategies, which have no NVMe one), on the 406M GPT (24 x 1024, vocabulary 100,352,
# micro batch 8 x 1024) and the 1.3B GPT (24 x 2048, vocabulary 50,304, micro batch 8 x 1024), 30 steps a
# row; stage3_nvme (a step of seconds, disk-bound) 8 steps.
#   PART=1  406M: torch; dstrain and the hand loop, the five presets without NVMe
#   PART=2  406M: Lightning, five presets; dstrain and the hand loop on stage3_nvme
#   PART=3  1.3B: torch; dstrain and the hand loop, the five presets
#   PART=4  1.3B: Lightning, five presets; torch again (the machine may be a new one)
set -u
W=/tmp/wmatrix; mkdir -p $W
FIVE=stage1,stage2,stage3,stage2_offload,stage3_offload
M406="--n-layer 24 --d-model 1024 --n-head 16 --vocab-size 100352 --out $OUT/m406"
B13="--n-layer 24 --d-model 2048 --n-head 16 --vocab-size 50304 --out $OUT/b13"
S="python3 benchmarks/suite.py --work $W --gpus 1 --steps 30 --row-timeout 120"
ops() {
  ( OPS="${1:-FusedAdamBuilder CPUAdamBuilder}" bash benchmarks/gpu_ops.sh
    python3 -c "from dstrain.rank.adam_nogil import load_adam_without_gil as f; f(); print('op dstrain_cpu_adam_nogil: ready')"
  ) > $OUT/ops.log 2>&1
}
case ${PART:-1} in
  1) ops & OPSPID=$!
     $S $M406 --runners torch --presets stage2 > $OUT/torch.log 2>&1
     wait $OPSPID
     $S $M406 --runners dstrain,deepspeed --presets $FIVE > $OUT/rows.log 2>&1 ;;
  2) ops "FusedAdamBuilder CPUAdamBuilder AsyncIOBuilder" & OPSPID=$!
     $S $M406 --runners lightning --presets $FIVE > $OUT/rows.log 2>&1
     wait $OPSPID
     python3 benchmarks/suite.py --work $W --gpus 1 --steps 8 --warmup 2 --log-every 2 --row-timeout 150 $M406 \
       --runners dstrain,deepspeed --presets stage3_nvme > $OUT/nvme.log 2>&1 ;;
  3) ops & OPSPID=$!
     $S $B13 --runners torch --presets stage2 > $OUT/torch.log 2>&1
     wait $OPSPID
     $S $B13 --runners dstrain,deepspeed --presets $FIVE > $OUT/rows.log 2>&1 ;;
  4) ops & OPSPID=$!
     $S $B13 --runners lightning --presets $FIVE > $OUT/rows.log 2>&1
     wait $OPSPID
     $S $B13 --runners torch --presets stage2 > $OUT/torch.log 2>&1 ;;
esac
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
grep -h "ZeRO-3\|CPU offload" $W/*.log 2>/dev/null | sed 's/^\[ *[0-9.]*s\] //' | sort | uniq -c | head -6
for f in ops torch rows nvme; do [ -f $OUT/$f.log ] || continue; echo "== $f"
  grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)|ready|FAILED" $OUT/$f.log | grep -v "  -  "; done
