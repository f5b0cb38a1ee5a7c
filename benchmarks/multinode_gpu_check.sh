#!/bin/bash
# Multi-node check on one 4-GPU machine (issue 37, item 4): two `--no-ssh` "nodes" of 2 GPUs each
# (CUDA_VISIBLE_DEVICES=0,1 and 2,3, node ranks 0 and 1, master 127.0.0.1) train one ZeRO-3 job of a small
# built-in GPT over NCCL, saving checkpoints; then the checkpoint at RESUME_AT is resumed on 1 node x 4 GPUs
# (the same world size) and on 1 node x 2 GPUs (a universal checkpoint, grad accum 2 for the same global
# batch). Each resumed run's losses are set beside the two-node run's, step by step: continuity.
#
#   bash benchmarks/multinode_gpu_check.sh                  # on the GPU machine, from the project root
#   ACCEL=cpu bash benchmarks/multinode_gpu_check.sh        # the same layout with CPU ranks (a dry check)
#
# On the device machine: carry [".whl"], kind nvidia-h100-x4; the script sources benchmarks/gpu_env.sh when
# .whl/ is there. Results go to $OUT/multinode (or ./multinode_check): each job's log, losses.tsv,
# summary.txt and results.json. Exit 0 when every job finished and the losses after each resume stay within
# the tolerances below of the two-node run's.
set -u
cd "$(dirname "$0")/.."
if [ -d .whl ]; then
  source benchmarks/gpu_env.sh || { echo "gpu_env.sh failed"; exit 1; }
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

ACCEL=${ACCEL:-cuda}
RESULTS=${OUT:-$PWD/multinode_check}/multinode
WORK=${WORK:-/tmp/dstrain_multinode}
PORT=${MASTER_PORT:-29531}
if [ "$ACCEL" = cuda ]; then
  # Each job takes about a minute; a hung one is stopped in time for the summary to come back within one
  # 10-minute device call (the fused Adam build before them: about a minute).
  PHASE_TIMEOUT=${PHASE_TIMEOUT:-160}
  STEPS=${STEPS:-30}; RESUME_AT=${RESUME_AT:-20}; SAVE_EVERY=${SAVE_EVERY:-10}
  MODEL=(model.n_layer=4 model.n_head=4 model.d_model=256 data.seq_len=256 train.micro_batch_size=8)
  TOL_SAME=${TOL_SAME:-0.02}; TOL_OTHER=${TOL_OTHER:-0.05}   # bf16, other reduction orders
else
  PHASE_TIMEOUT=${PHASE_TIMEOUT:-900}
  STEPS=${STEPS:-4}; RESUME_AT=${RESUME_AT:-2}; SAVE_EVERY=${SAVE_EVERY:-2}
  MODEL=(model.n_layer=2 model.n_head=2 model.d_model=32 data.seq_len=32 train.micro_batch_size=4)
  TOL_SAME=${TOL_SAME:-0.001}; TOL_OTHER=${TOL_OTHER:-0.001}  # fp32 on gloo
fi
COMMON=("${MODEL[@]}" "train.max_steps=$STEPS" "train.save_every=$SAVE_EVERY" "train.log_every=1"
        "train.eval_every=$STEPS" "train.keep_last=100" "train.schedule=constant" "train.warmup_steps=2"
        "train.lr=1e-3")
SETS=(); for item in "${COMMON[@]}"; do SETS+=(--set "$item"); done
TAG=$(printf "step%08d" "$RESUME_AT")

rm -rf "$WORK" && mkdir -p "$WORK" "$RESULTS"
{ echo "accelerator $ACCEL, steps $STEPS, resume at $RESUME_AT, save every $SAVE_EVERY"; date -u
  nvidia-smi -L 2>/dev/null; python3 -c "import torch, deepspeed; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__)"
} > "$RESULTS/env.txt" 2>&1
cat "$RESULTS/env.txt"

# The fused Adam op once, before two nodes would build it at the same time (each waits on the other's lock).
if [ "$ACCEL" = cuda ]; then
  python3 -c "from deepspeed.ops.op_builder import FusedAdamBuilder as B; B().load()" > "$RESULTS/ops.log" 2>&1 \
    && echo "op FusedAdam: ready" || { echo "op FusedAdam: FAILED"; tail -20 "$RESULTS/ops.log"; }
fi

# Which processes hold which GPU, every 5 s while the two nodes train: node 1's ranks must be on GPUs 2 and 3.
sample_gpus() {
  while true; do
    nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv,noheader 2>/dev/null | sed "s/^/$(date +%s) /"
    sleep 5
  done
}

run() {  # run NAME [dstrain run arguments...]: one dstrain run, its log in RESULTS, its exit code returned
  local name=$1; shift
  timeout -s TERM "$PHASE_TIMEOUT" python3 -m dstrain.cli run --preset stage3 --accelerator "$ACCEL" "$@" \
    "${SETS[@]}" > "$RESULTS/$name.log" 2>&1
}

echo "== two nodes x 2 ranks, one ZeRO-3 job =="
[ "$ACCEL" = cuda ] && { nvidia-smi -L > "$RESULTS/gpus.txt" 2>&1; sample_gpus > "$RESULTS/gpu_use.txt" & SAMPLER=$!; }
NODE=(--nodes 2 --gpus 2 --no-ssh --master-addr 127.0.0.1 --master-port "$PORT" --run-dir "$WORK/two_nodes")
CUDA_VISIBLE_DEVICES=0,1 run node0 "${NODE[@]}" --node-rank 0 &
PID0=$!
sleep 2
CUDA_VISIBLE_DEVICES=2,3 run node1 "${NODE[@]}" --node-rank 1 &
PID1=$!
wait $PID0; CODE0=$?
wait $PID1; CODE1=$?
[ -n "${SAMPLER:-}" ] && kill "$SAMPLER" 2>/dev/null
echo "node 0 exit $CODE0, node 1 exit $CODE1"

echo "== resumed from $TAG on 1 node x 4 ranks (same world size) =="
CUDA_VISIBLE_DEVICES=0,1,2,3 run four --gpus 4 --run-dir "$WORK/four" --resume "$WORK/two_nodes/checkpoints/$TAG"
CODE4=$?
echo "exit $CODE4"

echo "== resumed from $TAG on 1 node x 2 ranks (universal checkpoint, grad accum 2) =="
CUDA_VISIBLE_DEVICES=0,1 run two --gpus 2 --run-dir "$WORK/two" --resume "$WORK/two_nodes/checkpoints/$TAG" \
  --set train.grad_accum_steps=2
CODE2=$?
echo "exit $CODE2"

# Keep the run files small enough to come back: metrics, launch/config files, rank records.
for d in two_nodes four two; do
  mkdir -p "$RESULTS/$d"
  cp "$WORK/$d"/{metrics.jsonl,launch.json,config.yaml,ds_config.json} "$RESULTS/$d/" 2>/dev/null
  cp -r "$WORK/$d/ranks" "$RESULTS/$d/" 2>/dev/null
done

python3 - "$WORK" "$RESULTS" "$RESUME_AT" "$STEPS" "$TOL_SAME" "$TOL_OTHER" "$CODE0" "$CODE1" "$CODE4" "$CODE2" <<'EOF'
import json, sys
from pathlib import Path
work, results = Path(sys.argv[1]), Path(sys.argv[2])
resume_at, steps, tol_same, tol_other = int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]), float(sys.argv[6])
codes = dict(zip(("node0", "node1", "four", "two"), map(int, sys.argv[7:11])))

def losses(name):
    path = work / name / "metrics.jsonl"
    rows = [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []
    return {r["step"]: r["loss"] for r in rows if "loss" in r}

def world(name):
    path = work / name / "launch.json"
    return json.loads(path.read_text())["world_size"] if path.exists() else None

base, four, two = losses("two_nodes"), losses("four"), losses("two")
lines = ["step\ttwo_nodes(2x2)\tresumed 1x4\tresumed 1x2"]
for step in range(max(1, resume_at - 3), steps + 1):
    cells = [f"{run[step]:.6f}" if step in run else "-" for run in (base, four, two)]
    lines.append(f"{step}\t" + "\t".join(cells))
(results / "losses.tsv").write_text("\n".join(lines) + "\n")

def worst(run):
    after = [s for s in range(resume_at + 1, steps + 1)]
    if not all(s in run and s in base for s in after):
        return None
    return max(abs(run[s] - base[s]) / abs(base[s]) for s in after)

checks = {"jobs finished": all(c == 0 for c in codes.values()),
          "two-node run logged every step": sorted(base) == list(range(1, steps + 1)),
          "two-node world size 4": world("two_nodes") == 4}
rel4, rel2 = worst(four), worst(two)
checks[f"1x4 losses within {tol_same} of the two-node run's"] = rel4 is not None and rel4 <= tol_same
checks[f"1x2 losses within {tol_other} of the two-node run's"] = rel2 is not None and rel2 <= tol_other
checks["resumed runs start after the checkpoint"] = min(four, default=0) == min(two, default=0) == resume_at + 1
ranks_ok = all((work / "two_nodes" / "ranks" / f"rank{r}.exit").is_file() and
               (work / "two_nodes" / "ranks" / f"rank{r}.exit").read_text() == "ok" for r in range(4))
checks["all four ranks of the two-node job exited ok"] = ranks_ok
summary = {"exit_codes": codes, "max_rel_diff_after_resume": {"1x4": rel4, "1x2": rel2},
           "checks": checks, "passed": all(checks.values())}
(results / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
text = "\n".join(lines) + "\n\n" + "\n".join(f"{'ok  ' if v else 'FAIL'} {k}" for k, v in checks.items())
text += f"\nmax relative loss difference after the resume: 1x4 {rel4}, 1x2 {rel2}\n"
(results / "summary.txt").write_text(text)
print(text)
sys.exit(0 if summary["passed"] else 1)
EOF
CODE=$?
if [ "$CODE" -ne 0 ]; then
  for log in node0 node1 four two; do echo "--- tail of $log.log"; tail -25 "$RESULTS/$log.log" 2>/dev/null; done
fi
exit $CODE
