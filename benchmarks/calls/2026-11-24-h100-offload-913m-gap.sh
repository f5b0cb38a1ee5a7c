#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`, on the issue's 913M shape:
# why dstrain's offload rows (16,841 / 14,681 tokens/s in 2026-11-24-h100-issue-shape) run below the hand
# loop with the same offload changes (23,720 / 19,292 in 2026-11-24-h100-offload-913m-phases). The host's
# CPUs; the hand loop with dstrain's changes; dstrain as shipped, with the early start off, and with
# OMP_NUM_THREADS set to the physical cores, on one machine, alternating.
set -u
W=/tmp/wgap; mkdir -p $W
SHAPE="--n-layer 16 --d-model 2048 --n-head 16 --vocab-size 50304 --seq-len 2048 --micro-batch 4"
S="python3 benchmarks/suite.py --work $W --gpus 1 $SHAPE"
( lscpu; nproc; python3 -c "import torch; print('torch threads', torch.get_num_threads())" ) > $OUT/cpus.log 2>&1
( OPS="FusedAdamBuilder CPUAdamBuilder" bash benchmarks/gpu_ops.sh
  python3 -c "from dstrain.rank.adam_nogil import load_adam_without_gil as f; f(); print('op dstrain_cpu_adam_nogil: ready')"
) > $OUT/ops.log 2>&1
PHYS=$(lscpu -p=CORE | grep -v '^#' | sort -u | wc -l)
echo "physical cores: $PHYS" >> $OUT/cpus.log
# stage3 jobs start without the early start already (finding 27): no such row for stage3_offload
for P in stage2_offload stage3_offload; do
  NOEARLY=(); [ $P = stage2_offload ] && NOEARLY=(--variant "noearly@dstrain=train.log_every=5;+env:DSTRAIN_EARLY_START=0")
  $S --out $OUT/gap-$P --runners deepspeed,dstrain --presets $P --steps 20 --no-base --row-timeout 150 \
    --variant "hand@deepspeed=+dstrain_offload" \
    --variant "shipped@dstrain=train.log_every=5" "${NOEARLY[@]}" \
    --variant "omp$PHYS@dstrain=train.log_every=5;+env:OMP_NUM_THREADS=$PHYS" > $OUT/gap-$P.log 2>&1
done
cat $OUT/cpus.log | grep -i "model name\|^CPU(s)\|Thread\|Core\|Socket\|NUMA\|physical\|torch threads"
for f in ops gap-stage2_offload gap-stage3_offload; do echo "== $f"; grep -v "^    |" $OUT/$f.log | grep -v "^  " | tail -n 8; done
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
