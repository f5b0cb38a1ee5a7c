#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`, on the issue's 913M shape
# (16 x 2048, 16 heads, vocabulary 50,304, sequence 2048, micro batch 4): where the offload presets' step
# goes. The hand loop with dstrain's offload changes (+dstrain_offload), each phase timed with the GPU
# synchronised around it (+phases), and torch.profiler's tables (--profile); stage2 without offload as
# the phases' reference; a torch row on the same machine.
set -u
W=/tmp/wphases; mkdir -p $W
SHAPE="--n-layer 16 --d-model 2048 --n-head 16 --vocab-size 50304 --seq-len 2048 --micro-batch 4"
S="python3 benchmarks/suite.py --work $W --gpus 1 $SHAPE"
( OPS="FusedAdamBuilder CPUAdamBuilder" bash benchmarks/gpu_ops.sh
  python3 -c "from dstrain.rank.adam_nogil import load_adam_without_gil as f; f(); print('op dstrain_cpu_adam_nogil: ready')"
) > $OUT/ops.log 2>&1 &
OPSPID=$!
$S --out $OUT/torch --runners torch --presets stage2 --steps 40 --row-timeout 120 > $OUT/torch.log 2>&1
wait $OPSPID
$S --out $OUT/phases --runners deepspeed --presets stage2,stage2_offload,stage3_offload --steps 20 --no-base \
  --row-timeout 240 --profile --profile-runners deepspeed \
  --variant "ph@deepspeed=+dstrain_offload;+phases" > $OUT/phases.log 2>&1
for f in ops torch phases; do echo "== $f"; grep -v "^    |" $OUT/$f.log | tail -n 8; done
python3 - $OUT/phases <<'PY'
import json, sys, pathlib
for f in pathlib.Path(sys.argv[1]).glob("*.json"):
    for r in json.loads(f.read_text())["rows"]:
        print(r["preset"], r.get("variant"), r.get("tokens_per_s"), r.get("phases_ms"))
        prof = r.get("profile") or {}
        print("kernel ms/step", prof.get("kernel_ms_per_step"))
        print(prof.get("top_device", ""))
PY
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
