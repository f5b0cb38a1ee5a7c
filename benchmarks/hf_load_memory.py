"""Peak host RAM of loading a pretrained Hugging Face model into dstrain's ranks: ZeRO-3 (built under
deepspeed.zero.Init, weights copied into the partitions one tensor at a time) against ZeRO-2
(transformers' from_pretrained on every rank, the whole model per rank).

    python3 benchmarks/hf_load_memory.py make models/llama-1b            # ~1.1B Llama, random, bf16 on disk
    python3 benchmarks/hf_load_memory.py measure models/llama-1b --ranks 2 --accelerator cpu
    python3 benchmarks/hf_load_memory.py measure models/llama-1b --ranks 2 --presets stage3 --json out.json

`measure` starts each preset's ranks through the real deepspeed launcher; every rank runs exactly
dstrain's build_model (dstrain.models.build_model, as the worker does) with the preset's resolved
DeepSpeed config, while a thread samples its resident memory every 20 ms (/proc/self/status:
RssAnon = the process's own memory, RssFile = pages of memory-mapped files such as the safetensors
being read, which the kernel can drop). Reported per preset: the largest rank's peak RssAnon and
peak RSS, and their sums over the ranks (an upper bound of the node's peak: the ranks' peaks need
not coincide). Loading dtype is float32 (dstrain's default for hf: models).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

GiB = 2**30
LLAMA_1B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False)


def make(directory: Path, layers: int | None) -> None:
    """A Llama-style model of ~1.1B parameters (TinyLlama's shape) with random weights, saved in bf16."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    shape = dict(LLAMA_1B, **({"num_hidden_layers": layers} if layers else {}))
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**shape), dtype=torch.bfloat16)
    model.save_pretrained(directory, max_shard_size="1GB")
    print(f"saved {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters to {directory}")


class Sampler(threading.Thread):
    """This process's peak RssAnon and VmRSS (bytes), sampled every 20 ms."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak_anon = self.peak_rss = 0
        self.running = True

    @staticmethod
    def read() -> tuple[int, int]:
        fields = {}
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("RssAnon", "VmRSS"):
                fields[key] = int(value.split()[0]) * 1024
        return fields["RssAnon"], fields["VmRSS"]

    def run(self):
        while self.running:
            anon, rss = self.read()
            self.peak_anon, self.peak_rss = max(self.peak_anon, anon), max(self.peak_rss, rss)
            time.sleep(0.02)


def probe(model_dir: str, preset: str, accelerator: str, world: int, output: Path) -> None:
    """Inside one rank: build the model as dstrain's worker does, record this rank's peak memory."""
    from dstrain.config.resolve import resolve
    from dstrain.rank.runtime import init_rank

    rank, world_size, device = init_rank()
    resolved = resolve(preset, None, [f"model.name=hf:{model_dir}", "train.micro_batch_size=1"],
                       world_size=world, accelerator=accelerator)
    from dstrain.models import build_model
    sampler = Sampler()
    before = Sampler.read()
    sampler.start()
    started = time.perf_counter()
    model = build_model(resolved.config, resolved.ds_config, device)
    seconds = time.perf_counter() - started
    sampler.running = False
    sampler.join()
    params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    (output / f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "params": params, "seconds": seconds, "before_anon": before[0], "before_rss": before[1],
        "peak_anon": sampler.peak_anon, "peak_rss": sampler.peak_rss}))


def measure(model_dir: Path, ranks: int, presets: list[str], accelerator: str) -> list[dict]:
    rows = []
    for preset in presets:
        with tempfile.TemporaryDirectory() as scratch:
            env = {**os.environ, "DS_ACCELERATOR": accelerator}
            command = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), "--master_port",
                       str(29500 + os.getpid() % 1000), __file__, "probe", str(model_dir), "--preset", preset,
                       "--accelerator", accelerator, "--ranks", str(ranks), "--out", scratch]
            done = subprocess.run(command, env=env, capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"{preset} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
            per_rank = [json.loads(p.read_text()) for p in sorted(Path(scratch).glob("rank*.json"))]
        rows.append({"preset": preset, "ranks": ranks, "params": per_rank[0]["params"],
                     "load_s": max(r["seconds"] for r in per_rank),
                     "max_rank_peak_anon_gib": max(r["peak_anon"] for r in per_rank) / GiB,
                     "max_rank_peak_rss_gib": max(r["peak_rss"] for r in per_rank) / GiB,
                     "sum_peak_anon_gib": sum(r["peak_anon"] for r in per_rank) / GiB,
                     "sum_peak_rss_gib": sum(r["peak_rss"] for r in per_rank) / GiB,
                     "before_anon_gib": max(r["before_anon"] for r in per_rank) / GiB})
    return rows


def versions() -> dict:
    import deepspeed
    import torch
    import transformers
    return {"torch": torch.__version__, "deepspeed": deepspeed.__version__, "transformers": transformers.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_make = sub.add_parser("make")
    p_make.add_argument("directory", type=Path)
    p_make.add_argument("--layers", type=int, default=None, help="fewer layers for a smaller model")
    for name in ("measure", "probe"):
        p = sub.add_parser(name)
        p.add_argument("model_dir", type=Path)
        p.add_argument("--ranks", type=int, default=2)
        p.add_argument("--accelerator", default="cpu")
        p.add_argument("--presets", default="stage3,stage2")
        p.add_argument("--preset", default="stage3")
        p.add_argument("--out", type=Path)
        p.add_argument("--json", type=Path)
    args, _ = parser.parse_known_args()  # the launcher appends --local_rank
    if args.command == "make":
        make(args.directory, args.layers)
    elif args.command == "probe":
        probe(str(args.model_dir.resolve()), args.preset, args.accelerator, args.ranks, args.out)
    else:
        rows = measure(args.model_dir.resolve(), args.ranks, args.presets.split(","), args.accelerator)
        print(f"{'preset':8} {'ranks':>5} {'params':>8} {'load s':>7} {'anon before':>12} {'rank peak anon':>15} "
              f"{'rank peak RSS':>14} {'sum anon':>9} {'sum RSS':>8}")
        for r in rows:
            print(f"{r['preset']:8} {r['ranks']:>5} {r['params'] / 1e9:>7.2f}B {r['load_s']:>7.1f} "
                  f"{r['before_anon_gib']:>8.2f} GiB "
                  f"{r['max_rank_peak_anon_gib']:>12.2f} GiB {r['max_rank_peak_rss_gib']:>10.2f} GiB "
                  f"{r['sum_peak_anon_gib']:>6.2f} GiB {r['sum_peak_rss_gib']:>5.2f} GiB")
        if args.json:
            import platform
            args.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "host": platform.node(),
                                             "accelerator": args.accelerator, "versions": versions(),
                                             "model_dir": str(args.model_dir), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
