#!/bin/bash
# Issue 39, target 3 at accumulation 8 on one GPU: torch's row, stage3_offload with the weights kept between
# micro steps (the default) and without, stage2_offload beside them; then py-spy samples every Python
# thread of the rank (the autograd thread's hooks included) in one more stage3_offload row
# (PYSPY=1, wheel under .whl/pyspy/): $OUT/pyspy.txt.
#
#   PYSPY=1 bash benchmarks/calls/offload_final.sh        # 1.65b
# Results: $OUT (see common.sh).
. "$(dirname "$0")/common.sh"
SHAPE=${SHAPE:-1.65b}
STEPS=${STEPS:-16}
A8="train.grad_accum_steps=8"
torch_row "$SHAPE"
suite 1 "$SHAPE" offload --steps "$STEPS" --row-timeout 110 --no-offload-bound --runners dstrain \
  --presets stage3_offload --no-base \
  --variant "a8@dstrain=$A8" --variant "nokeep8@dstrain=$A8;speedups.offload_keep_weights=false" \
  > "$OUT/offload.log" 2>&1
suite 1 "$SHAPE" offload2 --steps "$STEPS" --row-timeout 110 --no-offload-bound --runners dstrain \
  --presets stage2_offload --no-base --variant "a8@dstrain=$A8" >> "$OUT/offload.log" 2>&1
if [ "${PYSPY:-0}" = 1 ]; then
  pip install -q --no-deps .whl/pyspy/*.whl > "$OUT/pyspy.log" 2>&1
  suite 1 "$SHAPE" spy --steps 40 --row-timeout 150 --no-offload-bound --runners dstrain --presets stage3_offload \
    --no-base --variant "spy8@dstrain=$A8" >> "$OUT/pyspy.log" 2>&1 &
  pid=
  for _ in $(seq 90); do  # the rank itself, not the deepspeed launcher whose arguments name it
    for p in $(pgrep -f "dstrain.rank.worker"); do
      grep -q "deepspeed.launcher" "/proc/$p/cmdline" 2>/dev/null || pid=$p
    done
    [ -n "$pid" ] && break; sleep 1
  done
  sleep 45  # past the start-up and the first steps
  py-spy record --pid "$pid" --duration 8 --rate 200 --threads --idle --format raw -o "$OUT/pyspy-raw.txt" \
    >> "$OUT/pyspy.log" 2>&1
  wait
  python3 benchmarks/pyspy_tables.py "$OUT/pyspy-raw.txt" > "$OUT/pyspy.txt" 2>&1
fi
summarize "$OUT/torch.log" "$OUT/offload.log"
