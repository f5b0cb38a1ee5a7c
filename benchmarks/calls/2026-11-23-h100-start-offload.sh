#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), 406M GPT, 1 GPU, after `source benchmarks/gpu_env.sh`.
# 1. Start-up: dstrain stage2 (eager) and stage3 as before this change (DSTRAIN_EARLY_START=0,
#    DSTRAIN_BYTECODE_CACHE=off), then twice with both on (the first fills the bytecode cache).
# 2. stage2_offload without DeepSpeed's per-parameter waits (dstrain/rank/offload_syncs.py), at grad
#    accumulation 1, 4 and 16 (the hand loop's row, without the change, is in the previous call).
# Everything lands in $OUT/all.tgz plus summary.log (the device tool returns few files).
set -u
W=/tmp/w; R=$W/results; mkdir -p $W $R
OPS="FusedAdamBuilder CPUAdamBuilder" bash benchmarks/gpu_ops.sh > $R/ops.log 2>&1 &
OPSPID=$!
{ python3 -c "import os, sys; print('dont_write_bytecode', sys.flags.dont_write_bytecode, 'PYTHONDONTWRITEBYTECODE', os.environ.get('PYTHONDONTWRITEBYTECODE'))"
  T=$(python3 -c "import importlib.util as u; print(list(u.find_spec('torch').submodule_search_locations)[0])")
  echo "torch at $T; pyc files: $(ls $T/__pycache__ 2>/dev/null | wc -l); writable: $(test -w $T && echo yes || echo no)"; } > $R/probe.log 2>&1
save() { mkdir -p $R/$1-rows; mv $W/*.log $R/$1-rows/ 2>/dev/null; }
S="python3 benchmarks/suite.py --work $W --row-timeout 150 --gpus 1"
$S --out $R/torch --runners torch --presets stage1 --steps 30 > $R/torch.log 2>&1; save torch
wait $OPSPID
DSTRAIN_EARLY_START=0 DSTRAIN_BYTECODE_CACHE=off $S --out $R/before --runners dstrain --presets stage2,stage3 --steps 10 --set train.compile=false > $R/before.log 2>&1; save before
for pass in 1 2; do
  $S --out $R/after$pass --runners dstrain --presets stage2,stage3 --steps 10 --set train.compile=false > $R/after$pass.log 2>&1; save after$pass
done
$S --out $R/offload --runners dstrain --presets stage2_offload --steps 30 \
  --variant "ga4@dstrain=train.grad_accum_steps=4;train.log_every=1;train.max_steps=12" \
  --variant "ga16@dstrain=train.grad_accum_steps=16;train.log_every=1;train.max_steps=8" > $R/offload.log 2>&1; save offload
{ cat $R/probe.log; for f in ops torch before after1 after2 offload; do echo "== $f"; grep -v "^    |" $R/$f.log | grep -v "^runner\|^[a-z]*  *stage\|^torch  " | tail -n 8; done
  grep -H "ready in\|since the" $R/*-rows/dstrain-*.log; } > $OUT/summary.log 2>&1
tar -czf $OUT/all.tgz -C $W results
cat $OUT/summary.log
