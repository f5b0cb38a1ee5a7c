"""Peak host memory of `dstrain.tools.convert.convert_checkpoint` on a large ZeRO-3 checkpoint.

    python benchmarks/convert_memory.py --work-dir /tmp/convert_bench --params 1e9

1. Unless WORK_DIR/ckpt already holds one, trains a synthetic model of about PARAMS fp32
   parameters for one step with ZeRO stage 3 on 2 CPU ranks (the real `deepspeed`
   launcher; `deepspeed.zero.Init` so no rank ever holds the whole model) and saves it.
2. Converts it to WORK_DIR/OUTPUT (default model.safetensors) in a fresh process and prints that process's
   peak resident memory (ru_maxrss), plus the peaks of its anonymous and file-backed
   (memory-mapped) parts sampled from /proc, next to the size of one fp32 copy.

`--compare-deepspeed` also measures DeepSpeed's own zero_to_fp32 conversion the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

WIDTH = 8192  # each layer is a WIDTH x WIDTH Linear: 67M parameters


def num_layers(num_params: float) -> int:
    return max(1, round(num_params / (WIDTH * WIDTH + WIDTH)))


def build_model(num_params: float):
    from torch import nn

    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(num_layers(num_params))])


def train_and_save(num_params: float, save_dir: str) -> None:
    """Rank worker (run by the launcher): one SGD step under ZeRO-3, then save."""
    import deepspeed
    import torch

    deepspeed.init_distributed()
    config = {
        "train_micro_batch_size_per_gpu": 1,
        # Small buckets: the defaults (5e8 elements = 2 GB fp32 per bucket) do not fit two
        # ranks of a 1B model next to each other in host memory.
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": 5e7,
            "stage3_prefetch_bucket_size": 5e7,
            "stage3_max_live_parameters": 1e8,
            "stage3_param_persistence_threshold": 1e4,
        },
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1000,
    }
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = build_model(num_params)
    # Plain SGD keeps no optimizer state, so the checkpoint is mostly the fp32 master weights.
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    loss = engine(torch.randn(1, WIDTH)).square().mean()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(save_dir)
    from dstrain.rank.runtime import end_rank
    end_rank()  # as dstrain's ranks end (dstrain/rank/runtime.py says why)


class PeakSampler:
    """Largest RssAnon and RssFile of this process, sampled every 20 ms from /proc."""

    def __init__(self) -> None:
        self.peak = {"RssAnon": 0, "RssFile": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for line in Path("/proc/self/status").read_text().splitlines():
                key, _, value = line.partition(":")
                if key in self.peak:
                    self.peak[key] = max(self.peak[key], int(value.split()[0]) * 1024)
            time.sleep(0.02)

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        return self.peak


def measure(which: str, checkpoint_dir: str, output: str, max_shard_size: str | None) -> None:
    """Convert in this (fresh) process and print its memory peaks as JSON."""
    import torch  # imported before sampling starts: the baseline is part of every tool's cost

    sampler = PeakSampler()
    start = time.time()
    if which == "dstrain":
        from dstrain.tools.convert import convert_checkpoint

        convert_checkpoint(Path(checkpoint_dir), Path(output), force=True, max_shard_size=max_shard_size)
    else:
        from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_state_dict

        convert_zero_checkpoint_to_state_dict(checkpoint_dir, output, max_shard_size=None,
                                              safe_serialization=True)
    seconds = time.time() - start
    peaks = sampler.stop()
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    print(json.dumps({"tool": which, "seconds": round(seconds, 1), "max_rss": max_rss, **peaks}))
    del torch


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/convert_bench"))
    parser.add_argument("--params", type=float, default=1e9)
    parser.add_argument("--output", default="model.safetensors", help="file name in WORK_DIR (.safetensors or .pt)")
    parser.add_argument("--max-shard-size", help='e.g. "1GB"; default: one file')
    parser.add_argument("--compare-deepspeed", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # set when launched as a rank
    parser.add_argument("--measure", choices=["dstrain", "deepspeed"], help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)  # from the launcher
    args = parser.parse_args()
    checkpoint_dir = args.work_dir / "ckpt"

    if args.worker:
        train_and_save(args.params, str(checkpoint_dir))
        return
    if args.measure:
        output = args.work_dir / (args.output if args.measure == "dstrain" else "deepspeed_out")
        measure(args.measure, str(checkpoint_dir), str(output), args.max_shard_size)
        return

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if not (checkpoint_dir / "latest").exists():
        start = time.time()
        launcher = Path(sys.executable).parent / "deepspeed"
        subprocess.run([str(launcher), "--num_gpus", "2", "--master_port", str(free_port()), __file__,
                        "--worker", "--work-dir", str(args.work_dir), "--params", str(args.params)],
                       check=True, env=env)
        print(f"checkpoint written in {time.time() - start:.0f} s")

    files = sorted((checkpoint_dir / (checkpoint_dir / "latest").read_text().strip()).iterdir())
    num_params = num_layers(args.params) * (WIDTH * WIDTH + WIDTH)
    print(f"checkpoint: {num_params / 1e9:.3f}B parameters, fp32 copy {num_params * 4 / 2**30:.2f} GiB; files:")
    for file in files:
        print(f"  {file.name}: {file.stat().st_size / 2**30:.2f} GiB")

    for tool in ["dstrain", "deepspeed"] if args.compare_deepspeed else ["dstrain"]:
        command = [sys.executable, __file__, "--measure", tool, "--work-dir", str(args.work_dir),
                   "--output", args.output]
        if args.max_shard_size:
            command += ["--max-shard-size", args.max_shard_size]
        result = subprocess.run(command, check=True, env=env, capture_output=True, text=True)
        peaks = json.loads(result.stdout.strip().splitlines()[-1])
        gib = {key: peaks[key] / 2**30 for key in ["max_rss", "RssAnon", "RssFile"]}
        print(f"{tool}: {peaks['seconds']} s, peak RSS {gib['max_rss']:.2f} GiB (anonymous {gib['RssAnon']:.2f} GiB, "
              f"memory-mapped files {gib['RssFile']:.2f} GiB)")


if __name__ == "__main__":
    main()
