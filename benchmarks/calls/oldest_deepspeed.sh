#!/bin/bash
# The speed layer on the oldest DeepSpeed of pyproject.toml's range: its GPU bit-identity tests and one
# performance row against torch, on one GPU. The wheel of that DeepSpeed is carried in DS_WHEELS
# (default .whl/oldest; build it with `DS_VERSION=0.18.9 bash ../shared/gpu/prepare.sh` into there).
#
#   source benchmarks/gpu_env.sh && bash benchmarks/calls/oldest_deepspeed.sh [PRESETS]
#
# A version not yet in dstrain/speedups/registry.py's VERIFIED gets every change skipped, which is what
# the tests would then see; CANDIDATE=1 lists it there in this (throwaway) copy of the tree first, so that
# the tests exercise the changes on it: the check a version must pass before it is added for real.
. "$(dirname "$0")/common.sh"
PRESETS=${1:-stage3}; STEPS=${STEPS:-40}
site=/tmp/site-oldest
if [ ! -f $site/deepspeed/__init__.py ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target $site "${DS_WHEELS:-.whl/oldest}"/deepspeed-*.whl
fi
export PYTHONPATH=$site:$PYTHONPATH TORCH_EXTENSIONS_DIR=/tmp/torch_ext_oldest
version=$(python3 -c "import deepspeed; print(deepspeed.__version__)")
echo "DeepSpeed $version from $(python3 -c 'import deepspeed, os; print(os.path.dirname(deepspeed.__file__))')" | tee "$OUT/versions.txt"
if [ "${CANDIDATE:-0}" = 1 ]; then
  sed -i "s/^VERIFIED = (/VERIFIED = (\"$version\", /" dstrain/speedups/registry.py
  grep "^VERIFIED" dstrain/speedups/registry.py | tee -a "$OUT/versions.txt"
fi
start_ops
wait_ops
python3 -m pytest -q -p no:cacheprovider tests/test_zero3_step.py tests/test_offload_step_zero3.py \
  tests/test_offload_syncs.py tests/test_zero3_flatten.py -k "gpu or current_stream" > "$OUT/gputests.log" 2>&1
tail -3 "$OUT/gputests.log"
suite 1 406m rows --steps "$STEPS" --runners torch,dstrain --presets "$PRESETS" > "$OUT/rows.log" 2>&1
summarize "$OUT/rows.log"
