#!/bin/bash
# DeepSpeed's ZeRO-3 autograd Functions applied without per-call signature binding
# (speedups.zero3_autograd_apply) on and off: stage3_offload at accumulation 8 and stage3 at 1, torch's row
# in the same call (issue 39). PYSPY=1 then samples the host's threads of one more stage3_offload row with
# py-spy (wheel under .whl/pyspy/), the autograd thread's Python included, into $OUT/pyspy.txt.
#
#   bash benchmarks/calls/zero3_apply.sh        # 1.65b
# Results: $OUT (see common.sh).
. "$(dirname "$0")/common.sh"
SHAPE=${SHAPE:-1.65b}
STEPS=${STEPS:-16}
A8="train.grad_accum_steps=8"
start_ops
suite 1 "$SHAPE" torch --steps 40 --runners torch --presets stage2 > "$OUT/torch.log" 2>&1
wait_ops
suite 1 "$SHAPE" apply --steps "$STEPS" --row-timeout 110 --no-offload-bound --runners dstrain \
  --presets stage3_offload --no-base \
  --variant "a8@dstrain=$A8" --variant "noapply8@dstrain=$A8;speedups.zero3_autograd_apply=false" \
  > "$OUT/apply.log" 2>&1
suite 1 "$SHAPE" apply3 --steps 30 --row-timeout 110 --runners dstrain --presets stage3 \
  --variant "noapply@dstrain=speedups.zero3_autograd_apply=false" >> "$OUT/apply.log" 2>&1
if [ "${PYSPY:-0}" = 1 ]; then
  pip install -q --no-deps .whl/pyspy/*.whl > "$OUT/pyspy.log" 2>&1
  suite 1 "$SHAPE" spy --steps 40 --row-timeout 150 --no-offload-bound --runners dstrain --presets stage3_offload \
    --no-base --variant "spy8@dstrain=$A8" >> "$OUT/pyspy.log" 2>&1 &
  for _ in $(seq 60); do pid=$(pgrep -f "dstrain.rank.worker" | head -1); [ -n "$pid" ] && break; sleep 1; done
  sleep 45  # past the start-up and the first steps
  py-spy record --pid "$pid" --duration 8 --rate 200 --threads --format raw -o "$OUT/pyspy-raw.txt" \
    >> "$OUT/pyspy.log" 2>&1
  wait
  python3 - "$OUT/pyspy-raw.txt" > "$OUT/pyspy.txt" 2>&1 <<'PY'
import collections, sys
own, total, by_thread = collections.Counter(), collections.Counter(), collections.Counter()
for line in open(sys.argv[1]):
    stack, _, count = line.rstrip().rpartition(" ")
    frames = stack.split(";")
    thread, frames, n = frames[0], frames[1:], int(count)
    by_thread[thread] += n
    if frames:
        own[(thread, frames[-1])] += n
    for frame in set(frames):
        total[(thread, frame)] += n
print("samples per thread:", dict(by_thread))
for title, table in (("own", own), ("in all", total)):
    print(f"\n== most samples ({title})")
    for (thread, frame), n in table.most_common(70):
        print(f"{n:6d}  {thread[:28]:28s}  {frame[:150]}")
PY
fi
summarize "$OUT/torch.log" "$OUT/apply.log"
