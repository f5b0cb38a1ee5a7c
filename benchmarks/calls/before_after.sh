#!/bin/bash
# dstrain as it is against dstrain at an earlier commit, on one machine, in alternating pairs: the check
# that a change meant to keep speed (the speed layer's move into dstrain/speedups, say) slowed no row.
#
#   git archive COMMIT dstrain presets benchmarks | tar -x -C .whl/before    # then carry .whl
#   bash benchmarks/calls/before_after.sh GPUS SHAPE PRESETS [PAIRS]
#   bash benchmarks/calls/before_after.sh 1 406m stage2,stage3,stage3_offload 2
#
# BEFORE (default .whl/before) is the earlier tree; its rows run from there with its own op builds (the two
# trees build dstrain's GIL-free Adam op under one name from different sources). STEPS default 40.
# Results: $OUT/before<i>/ and $OUT/after<i>/ (suite.py's JSON), logs summarized at the end.
. "$(dirname "$0")/common.sh"
GPUS=${1:?GPUS}; SHAPE=${2:?SHAPE}; PRESETS=${3:?PRESETS, e.g. stage2,stage3}; PAIRS=${4:-2}
STEPS=${STEPS:-40}
BEFORE=$(cd "${BEFORE:-.whl/before}" && pwd) || { echo "no earlier tree at ${BEFORE:-.whl/before}" >&2; exit 2; }
AFTER=$PWD
ops() {  # the DeepSpeed ops and the tree's own GIL-free Adam op, in TORCH_EXTENSIONS_DIR=$1, from tree $2
  ( cd "$2" && export TORCH_EXTENSIONS_DIR=$1 PYTHONPATH=/tmp/site:$2
    OPS="FusedAdamBuilder CPUAdamBuilder" bash "$AFTER/benchmarks/gpu_ops.sh"
    python3 -c "
try:
    from dstrain.speedups.cpu_adam_nogil import load_adam_without_gil
except ImportError:
    from dstrain.rank.adam_nogil import load_adam_without_gil
load_adam_without_gil(); print('op dstrain_cpu_adam_nogil: ready')" )
}
ops /tmp/torch_ext_before "$BEFORE" > "$OUT/ops-before.log" 2>&1 &
ops /tmp/torch_ext "$AFTER" > "$OUT/ops-after.log" 2>&1
wait
grep -h "ready\|FAILED" "$OUT"/ops-*.log
for i in $(seq "$PAIRS"); do
  ( cd "$BEFORE" && TORCH_EXTENSIONS_DIR=/tmp/torch_ext_before PYTHONPATH=/tmp/site:$BEFORE \
      python3 benchmarks/suite.py --work "$WORK/before" --gpus "$GPUS" $(shape_args "$SHAPE") --steps "$STEPS" \
      --runners dstrain --presets "$PRESETS" --out "$OUT/before$i" ) > "$OUT/before$i.log" 2>&1
  suite "$GPUS" "$SHAPE" "after$i" --steps "$STEPS" --runners dstrain --presets "$PRESETS" > "$OUT/after$i.log" 2>&1
done
summarize "$OUT"/before*.log "$OUT"/after*.log
