#!/bin/bash
# nvidia-h100-x1 device calls (issue 13), after `source benchmarks/gpu_env.sh`, on one machine held warm:
# stage3_offload after this session's two changes, the bf16 rounding in the host's Adam pass
# (DSTRAIN_OFFLOAD_HOST_ROUNDING=off: on the GPU, as before) and activation checkpointing "auto" (off where
# the estimate fits half the GPU; train.activation_checkpointing=true: as before); DeepSpeed's
# memory_efficient_linear off as a candidate; torch; the GPU tests of the ZeRO-3 offload step.
#   PART=1  406M GPT (24 x 1024, vocabulary 100,352, micro batch 8 x 1024)
#   PART=2  913M (16 x 2048, vocabulary 50,304, sequence 2048, micro batch 4) and 1.3B (24 x 2048, 8 x 1024)
#   PART=3  406M after the next two changes (the Adam tiles taken dynamically by the threads, Python's switch
#           interval at 0.25 ms beside the overlapped step): with it against DSTRAIN_OFFLOAD_GIL_HANDOFF=off
#           and against memory_efficient_linear off, alternating; the hand loop's phases
#   PART=4  406M: the host's Adam alone; the hand loop's phases with the worker's update time and the
#           forward's waits on it: as shipped, the worker on 16 threads, the main thread's OpenMP pool at 1
#           thread, the step before the forward; then PART=2's rows
#   PART=5  406M, the shipped tree with its peers: torch; dstrain, the hand loop and Lightning on the two
#           offload presets; dstrain's stage3_offload again last
#   PART=6  a shape named nowhere before (20 x 1536, 12 heads, vocabulary 32,000, sequence 2048, micro batch 4;
#           615M): torch; dstrain, the hand loop and Lightning on stage3_offload; dstrain's stage2_offload
set -u
W=/tmp/wfix; mkdir -p $W
S="python3 benchmarks/suite.py --work $W --gpus 1 --row-timeout 200"
M406="--n-layer 24 --d-model 1024 --n-head 16 --vocab-size 100352"
M913="--n-layer 16 --d-model 2048 --n-head 16 --vocab-size 50304 --seq-len 2048 --micro-batch 4"
B13="--n-layer 24 --d-model 2048 --n-head 16 --vocab-size 50304"
ops() {
  ( OPS="FusedAdamBuilder CPUAdamBuilder" bash benchmarks/gpu_ops.sh
    python3 -c "from dstrain.rank.adam_nogil import load_adam_without_gil as f; f(); print('op dstrain_cpu_adam_nogil: ready')"
  ) > $OUT/ops.log 2>&1
}
rows_913_13() {
  $S $M913 --steps 40 --out $OUT/r913 --runners torch --presets stage2 > $OUT/torch913.log 2>&1
  $S $M913 --steps 40 --out $OUT/r913 --runners dstrain --presets stage3_offload --no-base \
    --variant "shipped@dstrain=" --variant "before@dstrain=train.activation_checkpointing=true;+env:DSTRAIN_OFFLOAD_HOST_ROUNDING=off" \
    > $OUT/rows913.log 2>&1
  $S $B13 --steps 40 --out $OUT/r13 --runners torch --presets stage2 > $OUT/torch13.log 2>&1
  $S $B13 --steps 40 --out $OUT/r13 --runners dstrain --presets stage3_offload --no-base \
    --variant "shipped@dstrain=" --variant "before@dstrain=train.activation_checkpointing=true;+env:DSTRAIN_OFFLOAD_HOST_ROUNDING=off" \
    > $OUT/rows13.log 2>&1
}
case ${PART:-1} in
  1) ops & OPSPID=$!
     $S $M406 --steps 60 --out $OUT/r --runners torch --presets stage2 > $OUT/torch.log 2>&1
     wait $OPSPID
     python3 -m pytest -q -p no:cacheprovider tests/test_offload_step_zero3.py > $OUT/gputests.log 2>&1
     $S $M406 --steps 60 --out $OUT/r --runners dstrain --presets stage3_offload --no-base \
       --variant "shipped@dstrain=" --variant "ac_on@dstrain=train.activation_checkpointing=true" \
       --variant "gpu_round@dstrain=+env:DSTRAIN_OFFLOAD_HOST_ROUNDING=off" --variant "shipped2@dstrain=" \
       --variant "mel_off@dstrain=deepspeed.zero_optimization.memory_efficient_linear=false" \
       --variant "before@dstrain=train.activation_checkpointing=true;+env:DSTRAIN_OFFLOAD_HOST_ROUNDING=off" \
       --variant "shipped3@dstrain=" > $OUT/rows.log 2>&1
     $S $M406 --steps 40 --out $OUT/r --runners deepspeed --presets stage3_offload --no-base \
       --variant "ph@deepspeed=+dstrain_offload;+phases" > $OUT/phases.log 2>&1 ;;
  3) ops & OPSPID=$!
     $S $M406 --steps 60 --out $OUT/r --runners torch --presets stage2 > $OUT/torch.log 2>&1
     wait $OPSPID
     GIL="+env:DSTRAIN_OFFLOAD_GIL_HANDOFF=off"; MEL="deepspeed.zero_optimization.memory_efficient_linear=false"
     $S $M406 --steps 60 --out $OUT/r --runners dstrain --presets stage3_offload --no-base \
       --variant "shipped@dstrain=" --variant "gil_off@dstrain=$GIL" --variant "mel_off@dstrain=$MEL" \
       --variant "shipped2@dstrain=" --variant "gil_off2@dstrain=$GIL" --variant "mel_off2@dstrain=$MEL" \
       --variant "shipped3@dstrain=" > $OUT/rows.log 2>&1
     $S $M406 --steps 40 --out $OUT/r --runners deepspeed --presets stage3_offload --no-base \
       --variant "ph@deepspeed=+dstrain_offload;+phases" > $OUT/phases.log 2>&1 ;;
  4) ops
     python3 benchmarks/host_adam.py --threads 15 > $OUT/host_adam.log 2>&1
     $S $M406 --steps 40 --out $OUT/r --runners deepspeed --presets stage3_offload --no-base \
       --variant "ph@deepspeed=+dstrain_offload;+phases" \
       --variant "ph_t16@deepspeed=+dstrain_offload;+phases;+env:DSTRAIN_OFFLOAD_OVERLAP=16" \
       --variant "ph_omp1@deepspeed=+dstrain_offload;+phases;+env:DSTRAIN_OFFLOAD_OVERLAP=15;+env:OMP_NUM_THREADS=1" \
       --variant "ph_seq@deepspeed=+dstrain_offload;+phases;+env:DSTRAIN_OFFLOAD_OVERLAP=off" > $OUT/phases.log 2>&1
     rows_913_13 ;;
  2) rows_913_13 ;;
  6) M615="--n-layer 20 --d-model 1536 --n-head 12 --vocab-size 32000 --seq-len 2048 --micro-batch 4"
     ops & OPSPID=$!
     $S $M615 --steps 60 --out $OUT/r --runners torch --presets stage2 > $OUT/torch.log 2>&1
     wait $OPSPID
     $S $M615 --steps 40 --out $OUT/r --runners dstrain,deepspeed,lightning --presets stage3_offload > $OUT/rows.log 2>&1
     $S $M615 --steps 40 --out $OUT/r --runners dstrain --presets stage3_offload,stage2_offload --no-base \
       --variant "again@dstrain=" > $OUT/again.log 2>&1 ;;
  5) ops & OPSPID=$!
     $S $M406 --steps 60 --out $OUT/r --runners torch --presets stage2 > $OUT/torch.log 2>&1
     wait $OPSPID
     $S $M406 --steps 40 --out $OUT/r --runners dstrain,deepspeed,lightning --presets stage3_offload,stage2_offload \
       > $OUT/rows.log 2>&1
     $S $M406 --steps 40 --out $OUT/r --runners dstrain --presets stage3_offload --no-base --variant "again@dstrain=" \
       > $OUT/again.log 2>&1 ;;
esac
tar -czf $OUT/logs.tgz -C $W $(cd $W && ls *.log) -C $OUT r r913 r13 2>/dev/null
rm -rf $OUT/r $OUT/r913 $OUT/r13
grep -h "activation checkpointing o\|CPU offload, dstrain" $W/*.log 2>/dev/null | sed 's/^\[ *[0-9.]*s\] //' | sort | uniq -c | head -6
cat $OUT/host_adam.log 2>/dev/null
for f in ops gputests torch rows again phases torch913 rows913 torch13 rows13; do [ -f $OUT/$f.log ] || continue; echo "== $f"
  grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)|phases|ready|FAILED|passed|failed|Error" $OUT/$f.log | grep -v "  -  "; done
