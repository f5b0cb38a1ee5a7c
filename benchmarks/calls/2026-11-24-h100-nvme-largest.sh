#!/bin/bash
# One nvidia-h100-x1 device call (issue 13), after `source benchmarks/gpu_env.sh`: the largest model
# stage3_nvme trains on one H100 (64 GiB disk, 128 GiB RAM): benchmarks/largest_model.py from the
# planner's prediction, two steps a trial, NVMe files on the machine's disk. Ops built first.
set -u
df -h /tmp > $OUT/disk.txt 2>&1; free -g >> $OUT/disk.txt
OPS="CPUAdamBuilder AsyncIOBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1
python3 benchmarks/largest_model.py --presets stage3_nvme --deadline-s 500 --trial-steps 2 \
  --trial-timeout 300 --max-trials 3 --nvme-path /tmp/nvme-largest --work /tmp/w15 --out $OUT > $OUT/largest.log 2>&1
tail -30 $OUT/largest.log
