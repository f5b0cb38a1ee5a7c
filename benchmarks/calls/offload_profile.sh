#!/bin/bash
# Where an offload preset's step goes on one GPU: torch's row, then dstrain's offload rows at gradient
# accumulation 1 and 8, each again with profile.steps=1 (the profile's summary is in the row's JSON as
# profile_summary, and in profile-<row>.txt). Issue 39, target 3.
#
#   bash benchmarks/calls/offload_profile.sh                          # 1.65b, stage3_offload
#   SHAPE=1.3b PRESETS=stage2_offload,stage3_offload bash benchmarks/calls/offload_profile.sh
#   VARIANT='gpuacc@dstrain=train.grad_accum_steps=8;speedups.offload_accumulate=true' bash ...
#
# STEPS (default 16; the suite halves it for offload rows). Results: $OUT (see common.sh).
. "$(dirname "$0")/common.sh"
SHAPE=${SHAPE:-1.65b}
PRESETS=${PRESETS:-stage3_offload}
STEPS=${STEPS:-16}
extra=()
[ -n "${VARIANT:-}" ] && extra=(--variant "$VARIANT")
start_ops
if [ "${TORCH_ROW:-1}" = 1 ]; then
  suite 1 "$SHAPE" "torch-$SHAPE" --steps 60 --runners torch --presets stage2 > "$OUT/torch.log" 2>&1
fi
wait_ops
suite 1 "$SHAPE" "offload-$SHAPE" --steps "$STEPS" --runners dstrain --presets "$PRESETS" \
  --variant "accum8@dstrain=train.grad_accum_steps=8" \
  --variant "prof1@dstrain=profile.steps=1;profile.start_after=3" \
  --variant "prof8@dstrain=train.grad_accum_steps=8;profile.steps=1;profile.start_after=2" \
  "${extra[@]}" > "$OUT/offload.log" 2>&1
python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for path in out.glob("offload-*/*.json"):
    for row in json.loads(path.read_text()).get("rows", []):
        if row.get("profile_summary"):
            name = f"profile-{row['preset']}-{row.get('variant') or 'base'}.txt"
            (out / name).write_text(row["profile_summary"])
            print(f"== {name}\n" + "\n".join(row["profile_summary"].splitlines()[:8]))
PY
summarize "$OUT/torch.log" "$OUT/offload.log"
