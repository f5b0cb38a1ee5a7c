"""Where a rank's "model and engine" seconds go: the model build and deepspeed.initialize of a run
directory's resolved config, timed apart and under cProfile, in one process (rank 0 of 1).

    dstrain run --preset stage3 --run-dir /tmp/r --set train.max_steps=1   # writes the resolved config
    python3 benchmarks/engine_build_profile.py /tmp/r [--top 40]

The worker does the same between "ranks up" and "ready in" (dstrain/rank/worker.py, _build_engine);
this prints each part's time (the engine as the worker builds it), then cProfile's functions by total and by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args(argv)
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29517")):
        os.environ.setdefault(key, value)

    started = time.perf_counter()
    import torch

    from dstrain import rundir
    from dstrain.models import build_model
    from dstrain.rank.runtime import init_rank, initialize_engine, quiet_logging, seed_everything
    imported = time.perf_counter()
    config, ds_config, launch = rundir.read(args.run_dir)
    quiet_logging(False)
    _, _, device = init_rank()
    seed_everything(config.train.seed)
    joined = time.perf_counter()

    def synced() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    profile = cProfile.Profile()
    profile.enable()
    t0 = synced()
    model = build_model(config, ds_config, device)
    t1 = synced()
    engine = initialize_engine(model, ds_config, config.speedups)  # as the worker builds it
    t2 = synced()
    profile.disable()
    print(f"imports {imported - started:.2f} s, process group {joined - imported:.2f} s, "
          f"model build {t1 - t0:.2f} s, engine {t2 - t1:.2f} s "
          f"(ZeRO stage {engine.zero_optimization_stage()}, {sum(1 for _ in model.parameters())} parameters)",
          flush=True)
    for order in ("cumulative", "tottime"):
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats(order).print_stats(args.top)
        print(f"--- by {order}\n" + text.getvalue().split("\n", 6)[-1], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
