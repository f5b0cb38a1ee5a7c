"""The largest model each preset trains on one GPU of this machine, found by real `dstrain run`s.

Part of the GPU suite (benchmarks/suite.py measures speed; this measures size). For each preset it
trains a GPT of fixed width (--d-model, --n-head, --vocab-size, --seq-len, micro batch 1) and
searches its depth:

  1. dstrain's planner (`dstrain estimate`) predicts the deepest model that fits this GPU, this
     host's RAM and (stage3_nvme) the free space at --nvme-path;
  2. a trial is `dstrain run --preset P --gpus 1` for --trial-steps steps with no checkpoint; from
     the prediction the search steps up by --step (a fraction of the depth) until a trial fails, or
     down until one trains;
  3. then it bisects between the deepest success and the shallowest failure while time remains.

A trial fails on a CUDA out-of-memory error, on host memory running out (the search kills the trial
when the machine's available memory falls under --host-reserve-gib, before the kernel's OOM killer
picks a victim), on any other error, or on its timeout. Every trial records its peak GPU memory
(torch.cuda.max_memory_allocated, from metrics.jsonl), peak host RSS and step time, next to what the
planner estimated for it. Results: benchmarks/results/<date>-<device>-largest.json, written after
every trial.

    python3 benchmarks/largest_model.py --presets stage1,stage2,stage3 --deadline-s 540
    python3 benchmarks/largest_model.py --accelerator cpu --presets stage1 --d-model 64 --n-head 2 \\
        --vocab-size 256 --seq-len 32 --max-layers 8          # CPU smoke test of the search itself
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

import suite  # noqa: E402  (the suite's device and process helpers)
from run_record import dstrain_command, metrics, versions  # noqa: E402

GiB = 2**30
OOM_PATTERNS = ("CUDA out of memory", "OutOfMemoryError", "out of memory", "Cannot allocate memory")


def shape_sets(args, preset: str, n_layer: int) -> list[str]:
    sets = [f"model.n_layer={n_layer}", f"model.d_model={args.d_model}", f"model.n_head={args.n_head}",
            f"model.vocab_size={args.vocab_size}", f"data.seq_len={args.seq_len}", "data.source=synthetic",
            "train.micro_batch_size=1", f"train.max_steps={args.trial_steps}", "train.log_every=1",
            f"train.eval_every={10**9}", "train.eval_batches=1", "train.save_checkpoints=false"]
    if preset == "stage3_nvme":  # (dstrain run grows the swap buffer to the largest parameter itself)
        sets += [f"deepspeed.zero_optimization.{part}.nvme_path={args.nvme_path}"
                 for part in ("offload_param", "offload_optimizer")]
    return sets + list(args.set or [])


def estimate(args, preset: str, n_layer: int, hardware) -> dict:
    """The planner's figures for one depth (the same code as `dstrain estimate`)."""
    from dstrain.tools.estimate import memory as E
    from dstrain.config.resolve import resolve
    from dstrain.models import count_model, model_builder
    from dstrain.tools.estimate.memory import workload
    from dstrain.tools.estimate.planner import checkpointing_decision
    resolved = resolve(preset, None, shape_sets(args, preset, n_layer), world_size=1, accelerator=args.accelerator,
                       env={})
    cfg = resolved.config
    params, largest = count_model(model_builder(cfg))
    checkpointing, _ = checkpointing_decision(cfg, resolved.ds_config, params, largest, hardware)
    work = workload(cfg, resolved.ds_config, params, largest, checkpointing)
    est = E.estimate_one(preset, E.placement_from_ds_config(resolved.ds_config), work, hardware)
    return {"params": params, "fits": est.fits, "why": est.why, "gpu_gib": round(est.gpu_bytes_per_gpu / GiB, 2),
            "host_gib": round(est.cpu_bytes_per_node / GiB, 2), "nvme_gib": round(est.nvme_bytes / GiB, 2)}


def predicted_depth(args, preset: str, hardware) -> int:
    """The deepest model the planner says fits (bisection over depth; 0 if not even one layer)."""
    low, high = 0, args.max_layers + 1
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if estimate(args, preset, mid, hardware)["fits"] else (low, mid)
    return low


def trial(args, preset: str, n_layer: int, work: Path) -> dict:
    """One `dstrain run`; returns its outcome and measurements."""
    import psutil
    run_dir = work / f"{preset}-L{n_layer}"
    shutil.rmtree(run_dir, ignore_errors=True)
    if preset == "stage3_nvme":
        shutil.rmtree(args.nvme_path, ignore_errors=True)
        Path(args.nvme_path).mkdir(parents=True, exist_ok=True)
    cmd = dstrain_command(preset, 1, args.accelerator, run_dir, shape_sets(args, preset, n_layer))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    log_path = work / f"{preset}-L{n_layer}.log"
    t0 = time.time()
    host_low = False

    def host_low_now() -> bool:  # the trial is killed before the kernel's OOM killer picks a victim
        nonlocal host_low
        host_low = host_low or psutil.virtual_memory().available < args.host_reserve_gib * GiB
        return host_low
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        code, rss, _ = suite._rss_and_wait(process, args.trial_timeout, host_low_now)
    wall = time.time() - t0
    text = log_path.read_text(errors="replace")
    steps = [r for r in metrics(run_dir) if "tokens_per_s" in r]
    trained = code == 0 and steps and steps[-1]["step"] == args.trial_steps
    if trained:
        outcome = "ok"
    elif host_low:
        outcome = f"host memory (available fell under {args.host_reserve_gib} GiB; killed)"
    elif code is None:
        outcome = f"timeout ({args.trial_timeout:.0f} s)"
    elif any(p in text for p in OOM_PATTERNS):
        outcome = "GPU out of memory" if ("CUDA" in text or "cuda" in text) else "out of memory"
    else:
        outcome = f"failed (exit {code})"
    result = {"n_layer": n_layer, "outcome": outcome, "wall_s": round(wall, 1),
              "host_rss_gib": round(rss, 2),
              "peak_gpu_gib": round(steps[-1]["memory_gib"], 2) if steps and steps[-1].get("memory_gib") else None,
              # the last step's time (the first includes warm-up): tokens per step / its tokens/s
              "step_s": round(args.seq_len / steps[-1]["tokens_per_s"], 2) if steps and steps[-1]["tokens_per_s"] else None}
    if outcome not in ("ok",) and not outcome.startswith(("GPU out", "host memory", "timeout")):
        result["log_tail"] = text.splitlines()[-15:]
    if not args.keep_runs:
        shutil.rmtree(run_dir, ignore_errors=True)
    return result


def search(args, preset: str, hardware, work: Path, stop_at: float, record, entry: dict) -> None:
    """Fill `entry` (already in the results document, which `record` writes after every trial)."""
    predicted = predicted_depth(args, preset, hardware)
    entry["predicted_n_layer"] = predicted
    entry["predicted"] = estimate(args, preset, max(1, predicted), hardware)
    ok, failed = 0, args.max_layers + 1  # deepest trained, shallowest failed
    last_wall = 0.0

    def attempt(n_layer: int) -> bool:
        nonlocal ok, failed, last_wall
        r = trial(args, preset, n_layer, work)
        r["estimate"] = estimate(args, preset, n_layer, hardware)
        r["params"] = r["estimate"]["params"]
        entry["trials"].append(r)
        last_wall = r["wall_s"]
        print(f"{preset:15} L={n_layer:3} ({r['params'] / 1e9:6.2f}B)  {r['outcome']:40} wall {r['wall_s']:6.1f} s  "
              f"GPU {r['peak_gpu_gib']} GiB (est {r['estimate']['gpu_gib']})  host {r['host_rss_gib']} GiB "
              f"(est {r['estimate']['host_gib']})", flush=True)
        if r["outcome"] == "ok":
            ok = max(ok, n_layer)
        else:
            failed = min(failed, n_layer)
        record()
        return r["outcome"] == "ok"

    def time_left() -> bool:
        return time.monotonic() + max(last_wall * 1.2, 30) < stop_at and len(entry["trials"]) < args.max_trials

    step = lambda n: max(1, round(n * args.step))  # noqa: E731
    n = max(1, predicted)
    if attempt(n):
        while time_left() and n < args.max_layers and failed > args.max_layers:
            n = min(args.max_layers, n + step(n))
            if not attempt(n):
                break
    else:
        while time_left() and n > 1 and ok == 0:
            n = max(1, n - step(n))
            attempt(n)
    while time_left() and ok and failed - ok > 1:
        attempt((ok + failed) // 2)
    best = next((t for t in entry["trials"] if t["n_layer"] == ok and t["outcome"] == "ok"), None)
    entry["largest_trained"] = best and {k: best[k] for k in ("n_layer", "params", "peak_gpu_gib", "host_rss_gib", "step_s")}
    worst = next((t for t in entry["trials"] if t["n_layer"] == failed), None)
    entry["smallest_failed"] = worst and {k: worst[k] for k in ("n_layer", "params", "outcome")}
    entry["bracket_exact"] = bool(best and worst and failed - ok == 1)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--presets", default=",".join(suite.PRESETS))
    p.add_argument("--accelerator", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--d-model", type=int, default=4096)
    p.add_argument("--n-head", type=int, default=32)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--max-layers", type=int, default=400)
    p.add_argument("--step", type=float, default=0.1, help="step up/down as a fraction of the depth")
    p.add_argument("--trial-steps", type=int, default=3)
    p.add_argument("--trial-timeout", type=float, default=300.0)
    p.add_argument("--max-trials", type=int, default=5, help="per preset")
    p.add_argument("--deadline-s", type=float, default=3600.0, help="start no trial that would end after this")
    p.add_argument("--host-reserve-gib", type=float, default=4.0)
    p.add_argument("--nvme-path", default=str(Path(tempfile.gettempdir()) / "dstrain-largest-nvme"))
    p.add_argument("--set", action="append", help="extra dstrain override for every trial")
    p.add_argument("--keep-runs", action="store_true")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    p.add_argument("--work", type=Path, default=None)
    args = p.parse_args(argv)
    stop_at = time.monotonic() + args.deadline_s

    from dstrain.tools.estimate.memory import detect_hardware
    device, short, _ = suite._device_info(args.accelerator)
    Path(args.nvme_path).mkdir(parents=True, exist_ok=True)
    hardware = replace(detect_hardware(), gpus_per_node=1, nvme_free_bytes=shutil.disk_usage(args.nvme_path).free)
    work = args.work or Path(tempfile.mkdtemp(prefix="dstrain-largest-"))
    work.mkdir(parents=True, exist_ok=True)
    out_path = args.out / f"{datetime.date.today().isoformat()}-{short}-largest.json"
    doc = {"device": device, "versions": versions(),
           "host_ram_gib": round(hardware.cpu_mem_bytes / GiB, 1), "gpu_mem_gib": round(hardware.gpu_mem_bytes / GiB, 1),
           "nvme_free_gib": round(hardware.nvme_free_bytes / GiB, 1), "cpu_cores": os.cpu_count(),
           "family": {"d_model": args.d_model, "n_head": args.n_head, "vocab_size": args.vocab_size,
                      "seq_len": args.seq_len, "micro_batch": 1, "trial_steps": args.trial_steps},
           "command": "python3 benchmarks/largest_model.py " + " ".join(argv), "presets": {}}
    if out_path.exists():  # presets searched by an earlier call stay
        doc["presets"] = json.loads(out_path.read_text()).get("presets", {})

    def record():
        out_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = out_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        tmp.replace(out_path)
    print(f"{device}; host RAM {doc['host_ram_gib']} GiB; {doc['nvme_free_gib']} GiB free at {args.nvme_path}; "
          f"results -> {out_path}", flush=True)
    for preset in [x for x in args.presets.split(",") if x]:
        if time.monotonic() + 30 > stop_at:
            print(f"{preset}: not searched (deadline)")
            continue
        entry = doc["presets"][preset] = {"preset": preset, "trials": [], "status": "running"}
        search(args, preset, hardware, work, stop_at, record, entry)
        entry["status"] = "done"
        record()
    print()
    for name, e in doc["presets"].items():
        best, worst = e.get("largest_trained"), e.get("smallest_failed")
        print(f"{name:15} predicted L={e.get('predicted_n_layer')}  largest trained: "
              + (f"L={best['n_layer']} ({best['params'] / 1e9:.2f}B params)" if best else "none")
              + "  smallest failed: " + (f"L={worst['n_layer']} ({worst['outcome']})" if worst else "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
