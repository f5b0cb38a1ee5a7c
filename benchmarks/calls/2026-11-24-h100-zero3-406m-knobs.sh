#!/bin/bash
# One nvidia-h100-x1 device call (issue 13; the two-GPU kind was no longer lent), after `source benchmarks/gpu_env.sh`: DeepSpeed settings that
# take Python out of ZeRO-3's step on the 406M GPT, one GPU, where stage3 is 0.61 of torch (the two-GPU profile call: the host is
# the bottleneck, the device 55% busy). reduce_scatter=false sends each gradient bucket through one
# flat all-reduce instead of reduce_scatter_coalesced's per-tensor split; with it every parameter but
# the embedding persistent and DeepSpeed's memory-efficient linear off; the all-reduce fetch; larger
# prefetch. torch first, then hand loop rows, phase by phase, alternating with the base.
set -u
W=/tmp/w11; mkdir -p $W
Z=deepspeed.zero_optimization
P="$Z.stage3_param_persistence_threshold=20000000;$Z.memory_efficient_linear=false"
OPS="FusedAdamBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1 &
S="python3 benchmarks/suite.py --work $W --row-timeout 150 --gpus 1 --presets stage3 --steps 40"
$S --out $OUT/torch --runners torch > $OUT/torch.log 2>&1
wait
$S --out $OUT/knobs --runners deepspeed --no-base \
  --variant "base@deepspeed=+phases" \
  --variant "rsoff@deepspeed=$Z.reduce_scatter=false;+phases" \
  --variant "rsoff_pl@deepspeed=$Z.reduce_scatter=false;$P;+phases;+pyprofile" \
  --variant "rsoff_pl_ar@deepspeed=$Z.reduce_scatter=false;$P;$Z.stage3_use_all_reduce_for_fetch_params=true;+phases" \
  --variant "rsoff_pf@deepspeed=$Z.reduce_scatter=false;$Z.stage3_prefetch_bucket_size=200000000;+phases" \
  --variant "base2@deepspeed=+phases" \
  --variant "rsoff2@deepspeed=$Z.reduce_scatter=false;+phases" \
  --variant "rsoff_pl2@deepspeed=$Z.reduce_scatter=false;$P;+phases" \
  > $OUT/knobs.log 2>&1
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
for f in ops torch knobs; do echo "== $f"; grep -E "^(torch|dstrain|deepspeed|lightning) +(stage|none)|phases|profile:|ops ready|FAILED" $OUT/$f.log | grep -v "  -  "; done
