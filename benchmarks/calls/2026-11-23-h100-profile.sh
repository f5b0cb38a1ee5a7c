#!/bin/bash
# One nvidia-h100-x1 device call (issue 13): where start-up and the offload step go. 406M GPT, 1 GPU.
# After `source benchmarks/gpu_env.sh`, from the project root.
# 1. host facts and import times (twice each: cold, then page cache warm);
# 2. torch.profiler tables of the hand loop's stage2_offload and stage3_offload steps (--profile);
# 3. dstrain stage2 (eager) and stage3 rows (timestamped logs), then each run's rank re-run alone under
#    cProfile (same run directory, no launcher) to see what its 13 s of build are;
# 4. SuperOffload (stage 3; overlaps the CPU Adam step with backward only without clipping).
set -u
W=/tmp/w; mkdir -p $W
Z=deepspeed.zero_optimization
OPS="FusedAdamBuilder CPUAdamBuilder" bash benchmarks/gpu_ops.sh > $OUT/ops.log 2>&1
(nproc; lscpu | head -25; free -g; df -h /tmp) > $OUT/host.txt 2>&1
for i in 1 2; do
  /usr/bin/time -f "%e s  import torch ($i)" python3 -c "import torch" 2>> $OUT/imports.log
  /usr/bin/time -f "%e s  import torch, deepspeed ($i)" python3 -X importtime -c "import torch, deepspeed" 2> $OUT/importtime$i.txt
  tail -1 $OUT/importtime$i.txt >> $OUT/imports.log
done
( cd /tmp && /usr/bin/time -f "%e s  dstrain run --preset stage3 --dry-run" python3 -m dstrain.cli run --preset stage3 --gpus 1 --dry-run >/dev/null ) 2>> $OUT/imports.log
S="python3 benchmarks/suite.py --work $W --row-timeout 150 --gpus 1"
$S --out $OUT/offprof --runners deepspeed --presets stage2_offload,stage3_offload --steps 20 --profile > $OUT/offprof.log 2>&1
$S --out $OUT/start --runners dstrain --presets stage2,stage3 --steps 10 --keep-runs --set train.compile=false > $OUT/start.log 2>&1
port=29611
for p in stage2 stage3; do
  d=$W/dstrain-$p-1g-base; rm -rf $d/ranks $d/metrics.jsonl
  RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port DS_ACCELERATOR=cuda \
    timeout 120 python3 -m cProfile -o $OUT/$p.prof -m dstrain.rank.worker $d > $OUT/$p.cprofile.log 2>&1
  python3 -c "import pstats,sys; s=pstats.Stats(sys.argv[1]); s.sort_stats('cumulative').print_stats(60)" $OUT/$p.prof > $OUT/$p.pstats.txt 2>&1
  port=$((port+1))
done
$S --out $OUT/super --runners dstrain --presets stage3_offload --steps 30 --no-base \
  --variant "noclip@dstrain=deepspeed.gradient_clipping=0" \
  --variant "super@dstrain=$Z.offload_optimizer.super_offload=true;deepspeed.gradient_clipping=0" > $OUT/super.log 2>&1
for f in ops imports offprof start super; do echo "== $f"; grep -v "^    |" $OUT/$f.log | tail -n 14; done
head -45 $OUT/stage3.pstats.txt
tar -czf $OUT/rowlogs.tgz -C $W $(cd $W && ls *.log) 2>/dev/null
