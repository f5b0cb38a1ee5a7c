#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`, on the tidied tree (60a432b):
# the GPU tests of ZeRO-3's step and backward and the stream lookup; torch and dstrain stage3 at 406M, 60 steps.
# (Run as one inline command; this file records it.)
OPS="FusedAdamBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1
PYTHONPATH=$PYTHONPATH:$PWD/.whl/pytest-site timeout 240 python3 -m pytest -p no:cacheprovider -q \
  tests/test_zero3_step.py -k "gpu or fast_current" > $OUT/test.log 2>&1
python3 benchmarks/suite.py --work /tmp/wf --gpus 1 --steps 60 --row-timeout 150 --out /tmp/wf/res \
  --runners torch,dstrain --presets stage3 > $OUT/rows.log 2>&1
cp -r /tmp/wf/res $OUT/ 2>/dev/null
