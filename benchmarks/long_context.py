"""GPU benchmark: long sequences with and without sequence parallelism (train.sequence_parallel), through
`dstrain run` on a ~1.1B Llama-style model (TinyLlama's shape, random weights saved locally; or --model-dir).

    python3 benchmarks/long_context.py                                  # 1/2/4 GPUs (those present), 32K, then the longest
    python3 benchmarks/long_context.py --gpus 4 --seq-lens 32768,131072 --no-max
    python3 benchmarks/long_context.py --json benchmarks/results/2026-11-27-h100-long-context.json
    python3 benchmarks/long_context.py --model-dir /tmp/llama-1b --gpus 4 --seq-lens "" --max-from 65536  # max only
    python3 benchmarks/long_context.py --model-dir /tmp/llama-1b --gpus 1 --seq-lens 32768 \
        --variants off,tiled,offload,tiled+offload                     # the memory switches, one at a time
    python3 benchmarks/long_context.py --accelerator cpu --tiny --gpus 2 --seq-lens 64 --max-from 64 --max-to 256 \\
        --steps 3 --log-every 1 --warmup 1                              # CPU smoke test (minutes)

Rows: for every GPU count N, one run without sequence parallelism (each GPU its own sequences: data
parallel) and, for N > 1, one with train.sequence_parallel = N (each sequence split over the N GPUs); each at
every --seq-lens length, then (unless --no-max) the longest sequence that trains: the length doubles from
--max-from until a run fails (out of memory) or reaches --max-to, and the last length that trained is the
row's max_seq_len. Every run is a fresh `dstrain run` (ZeRO-3, bf16, activation checkpointing on, micro
batch 1, synthetic tokens, no checkpoints), so its peak memory is its own.

Measured per run, from metrics.jsonl: tokens/s (median over the log intervals after --warmup steps),
TFLOP/s per GPU and MFU (dstrain's: 6 x parameters + 12 x layers x width x seq_len FLOPs per token,
against the GPU's dense bf16 peak; recomputation not counted), and the peak GPU memory of rank 0.
The table is printed as rows come; --json writes every row, the date, the GPU and the versions.

--variants repeats every layout with the long-sequence memory switches (docs/long-context.md): "default"
(dstrain's own choices: train.tiled_mlp auto), "off" (tiled MLP off), "tiled" (train.tiled_mlp=true),
"offload" (train.activation_checkpointing_offload=true, tiled MLP off), "tiled+offload" (both).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from run_record import write_json

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

# --variants: the long-sequence memory switches each run gets
VARIANTS = {
    "default": [],
    "off": ["train.tiled_mlp=false"],
    "tiled": ["train.tiled_mlp=true"],
    "offload": ["train.tiled_mlp=false", "train.activation_checkpointing_offload=true"],
    "tiled+offload": ["train.tiled_mlp=true", "train.activation_checkpointing_offload=true"],
}

# Out of memory, as the rank reports it: torch on the GPU, or the kernel's OOM killer on CPU ranks
OOM_SIGNS = ("CUDA out of memory", "OutOfMemoryError", "out of memory", "exit -9", "signal 9", "SIGKILL")


def gpu_count() -> int:
    import torch
    return torch.cuda.device_count()


def make_tiny(directory: Path) -> None:
    """A 4-layer Llama of width 64 (4 heads, 2 key-value heads): for the CPU smoke test."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)


def run_row(model_dir: Path, gpus: int, sp: int, seq_len: int, args, variant: str = "default") -> dict:
    """One `dstrain run`; the row's figures, or its status ("oom", "failed") and the output's end."""
    row = {"gpus": gpus, "sequence_parallel": sp, "seq_len": seq_len, "variant": variant}
    with tempfile.TemporaryDirectory() as scratch:
        run_dir = Path(scratch) / "run"
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]  # synthetic ids below it
        sets = [f"model.name=hf:{model_dir}", "data.source=synthetic", f"model.vocab_size={vocab}",
                f"model.kwargs.max_position_embeddings={max(seq_len, 2048)}", f"data.seq_len={seq_len}",
                "train.micro_batch_size=1", f"train.max_steps={args.steps}", f"train.log_every={args.log_every}",
                "train.save_checkpoints=false", "train.eval_every=1000000", "train.eval_batches=1",
                "train.warmup_steps=2", "train.lr=1e-5", "train.activation_checkpointing=true",
                f"train.sequence_parallel={sp}", *VARIANTS[variant], *(args.set or [])]
        command = [sys.executable, "-m", "dstrain.cli", "run", "--preset", args.preset, "--gpus", str(gpus),
                   "--accelerator", args.accelerator, "--run-dir", str(run_dir)]
        for item in sets:
            command += ["--set", item]
        started = time.perf_counter()
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
        row["wall_s"] = round(time.perf_counter() - started, 1)
        output = done.stdout + done.stderr
        if done.returncode:
            row["status"] = "oom" if any(sign in output for sign in OOM_SIGNS) else "failed"
            row["error"] = output[-2000:]
            return row
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "tokens_per_s" in r]
    timed = [r for r in steps if r["step"] - args.log_every >= args.warmup] or steps[-1:]
    row.update(status="ok", tokens_per_s=statistics.median(r["tokens_per_s"] for r in timed), intervals=len(timed),
               first_loss=steps[0]["loss"], last_loss=steps[-1]["loss"],
               peak_memory_gib=max((r["memory_gib"] for r in steps if "memory_gib" in r), default=None))
    for key in ("tflops_per_device", "mfu"):
        values = [r[key] for r in timed if key in r]
        if values:
            row[key] = statistics.median(values)
    return row


def longest(model_dir: Path, gpus: int, sp: int, args, keep, variant: str = "default") -> dict:
    """The longest power-of-two multiple of --max-from up to --max-to that trains, with its run's figures."""
    best = None
    seq_len = args.max_from
    while seq_len <= args.max_to:
        row = run_row(model_dir, gpus, sp, seq_len, args, variant)
        keep(dict(row, search="max"))
        print(describe(row) + "  (search)", flush=True)
        if row["status"] != "ok":
            break
        best = row
        seq_len *= 2
    return {"gpus": gpus, "sequence_parallel": sp, "variant": variant, "max_seq_len": best["seq_len"] if best else None,
            "tokens_per_s": best.get("tokens_per_s") if best else None, "mfu": best.get("mfu") if best else None,
            "peak_memory_gib": best.get("peak_memory_gib") if best else None, "status": "max"}



def describe(row: dict) -> str:
    layout = f"SP {row['sequence_parallel']}" if row["sequence_parallel"] > 1 else "DP"
    if row.get("status") == "max":
        length = f"max {row['max_seq_len']:,}" if row["max_seq_len"] else "none fits"
    else:
        length = f"{row['seq_len']:,}"
    speed = f"{row['tokens_per_s']:,.0f}" if row.get("tokens_per_s") else ""
    mfu = f"{row['mfu']:.1%}" if row.get("mfu") is not None else ""
    memory = f"{row['peak_memory_gib']:.1f}" if row.get("peak_memory_gib") is not None else ""
    status = "" if row.get("status") in ("ok", "max") else row.get("status", "")
    return f"{row['gpus']:>4} {layout:>6} {row.get('variant', 'default'):>13} {length:>12} {speed:>10} {mfu:>6} {memory:>9} {status:>7}"


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The lengths and the run length, shared with long_context_peers.py so that its rows match."""
    parser.add_argument("--seq-lens", default="32768", help="comma-separated lengths measured on every layout")
    parser.add_argument("--no-max", action="store_true", help="skip the search for the longest sequence")
    parser.add_argument("--max-from", type=int, default=16384)
    parser.add_argument("--max-to", type=int, default=262144)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--log-every", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one run may take")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", default=None, help="comma-separated GPU counts (default: 1, 2, 4, those present)")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="the hf model folder: made there when it holds none, reused when it does (default: a temp dir)")
    parser.add_argument("--tiny", action="store_true", help="a tiny Llama instead of the 1.1B one (smoke test)")
    parser.add_argument("--preset", default="stage3")
    parser.add_argument("--accelerator", default="cuda", choices=["cuda", "cpu"])
    add_run_arguments(parser)
    parser.add_argument("--set", action="append", help="extra dstrain override for every run")
    parser.add_argument("--variants", default="default",
                        help=f"comma-separated memory-switch variants run on every layout: {', '.join(VARIANTS)}")
    parser.add_argument("--layouts", default="dp,sp", help="dp (each GPU its own sequences), sp (each sequence split over the GPUs), or both")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    present = gpu_count() if args.accelerator == "cuda" else 2
    counts = [int(g) for g in args.gpus.split(",")] if args.gpus else [g for g in (1, 2, 4) if g <= present]
    model_dir = args.model_dir or Path(tempfile.mkdtemp(prefix="dstrain-long-context-"))
    if not (model_dir / "config.json").is_file():  # made once; a later call names the same --model-dir
        model_dir.mkdir(parents=True, exist_ok=True)
        if args.tiny:
            make_tiny(model_dir)
        else:
            from hf_load_memory import make
            make(model_dir, None)
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown --variants {', '.join(unknown)}: use {', '.join(VARIANTS)}")
    wanted = set(args.layouts.split(","))
    layouts = [(g, sp, v) for g in counts for sp in ((1, g) if g > 1 else (1,)) for v in variants
               if ("sp" if sp > 1 else "dp") in wanted]
    rows: list[dict] = []
    print(f"{'GPUs':>4} {'layout':>6} {'variant':>13} {'seq_len':>12} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>9} {'status':>7}",
          flush=True)

    def keep(row: dict) -> None:  # printed and written as it comes: a later run that crashes, or a cut call,
        rows.append(row)           # loses nothing
        print(describe(row), flush=True)
        if args.json:
            write_json(args.json, vars(args), rows, quiet=True)

    for gpus, sp, variant in layouts:
        for seq_len in (int(s) for s in args.seq_lens.split(",") if s):
            keep(run_row(model_dir, gpus, sp, seq_len, args, variant))
        if not args.no_max:
            keep(longest(model_dir, gpus, sp, args, lambda row: rows.append(row), variant))
    if args.json:  # the last write, announced
        write_json(args.json, vars(args), rows)


if __name__ == "__main__":
    main()
