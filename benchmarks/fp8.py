"""GPU benchmark: train.precision fp8 (torchao's float8 training) against bf16 on one GPU or --gpus N (issue 55,
item 1).

    source .pbench/env.sh && python3 benchmarks/fp8.py --out $OUT                  # one H100/H200: ~6 minutes
    python3 benchmarks/fp8.py --layers 32 --stage 3 --gpus 2 --micro-batch 4 --out $OUT   # 8.0B on two H200s
    python3 benchmarks/fp8.py --rows bf16,fp8-tensorwise --steps 300 --out $OUT    # the 300-step loss check, ~8 min
    python3 benchmarks/fp8.py --tiny --out /tmp/o                                  # CPU: builds the data, then the
                                                                                   # rows are refused (no FP8 on CPU)
    python3 benchmarks/fp8.py plot DIR/fp8-h200.json docs/images/fp8-loss.png      # the loss curves (matplotlib)

What it builds (in --work, reused when there): a model of Llama-3-8B's layer shape (hidden 4096, MLP 14336,
32 heads, 8 key-value heads, rope theta 500,000) with --layers of its 32 layers (default 12) and a 32,000-token
vocabulary instead of its 128,256, so that the model and its optimizer fit one H100 at ZeRO-2 (2.88B parameters,
about 46 GiB of bf16 weights, fp32 masters and Adam states); random weights saved by save_pretrained in bf16
safetensors, with benchmarks/sft.py's byte-level BPE tokenizer; the data is real text: the standard library's
sources (dstrain's corpus), one text file, tokenized by that tokenizer (data.source text), the same sequences in
the same order for every row (same seed).

Rows, each a fresh `dstrain run --gpus N` (--gpus, default 1; --preset stage2 by default, --stage 3 for stage3),
seq 2048 x micro batch 2 on each GPU, lr 3e-4 with 20 warm-up steps then cosine, train.compile auto (each decoder
layer compiled: on for both; at ZeRO-3 on several GPUs past 3B auto leaves both eager, so pass
--dstrain-set train.compile=true there):
  bf16              train.precision bf16
  fp8-tensorwise    train.precision fp8, train.fp8_recipe tensorwise
  fp8-rowwise       train.precision fp8, train.fp8_recipe rowwise
  fp8-tensorwise-exact  as fp8-tensorwise, train.fp8_fast_accum false (the forward matmul accumulates in full
                    precision)
fp8 converts the linear layers of decoder layers 2 .. N-1 (the first and last layer and the LM head stay bf16):
with 12 layers 10/12 of the layers' matmuls, about 78% of the step's matmul FLOPs (the head's 4096 x 32,000
included). MFU is against the GPU's dense bf16 peak (as torchtitan reports its float8 rows), from dstrain's FLOPs
per token (6 x parameters + attention).

Reported per row: tokens/s and MFU over the steps after --warmup (their total tokens over their time; with
--gpus N the tokens/s of all N GPUs together, dstrain's global batch over the step time, and the MFU each GPU's
share against one GPU's peak, i.e. the total against N x that peak), peak GPU memory (rank 0's
torch.cuda.max_memory_allocated), the time to the first step (compile included), every step's loss, and
for each fp8 row its loss against bf16's: the mean relative difference over the steps and over the last 10. --out
(default $OUT, else WORK/out) gets fp8-<gpu>.json (fp8-<gpu>xN.json with --gpus N; date, device, versions,
settings, rows) and each row's log.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
import time
from pathlib import Path

from run_record import (bench_args, bench_parser, device_name, install_wheels, log, pick, rate, reuse_or_make_llama, run_dstrain, run_rows,
                        short_name, versions_in_child)

LLAMA3_8B_LAYER = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128, vocab_size=32000, max_position_embeddings=8192, tie_word_embeddings=False,
                       rms_norm_eps=1e-5, rope_theta=500000.0)
LLAMA_TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  vocab_size=512, max_position_embeddings=1024, tie_word_embeddings=False)
ROWS = (("bf16", ["train.precision=bf16"]),
        ("fp8-tensorwise", ["train.precision=fp8", "train.fp8_recipe=tensorwise"]),
        ("fp8-rowwise", ["train.precision=fp8", "train.fp8_recipe=rowwise"]),
        ("fp8-tensorwise-exact", ["train.precision=fp8", "train.fp8_recipe=tensorwise", "train.fp8_fast_accum=false"]))


def dstrain_row(name: str, sets: list[str], ctx: dict, args) -> dict:
    row = {"name": name, "stage": args.stage, "gpus": args.gpus, "sets": sets}
    all_sets = [f"model.name=hf:{ctx['model']}", "data.source=text", f"data.paths=[{ctx['model'] / 'corpus.txt'}]",
                f"data.seq_len={args.seq_len}", f"data.cache_dir={args.work / 'dstrain-cache'}",
                f"train.micro_batch_size={args.micro_batch}", f"train.max_steps={args.steps}",
                f"train.warmup_steps={min(20, args.steps // 5)}", "train.lr=3e-4", f"train.seed={args.seed}", *sets]
    started = time.time()
    result, steps = run_dstrain(name, f"stage{args.stage}", all_sets, args)
    row.update(result)
    if "error" in row:
        return row
    timed = [r for r in steps if r["step"] > args.warmup] or steps[-1:]
    log_text = (args.out / "logs" / f"{name}.log").read_text(errors="replace")
    converted = re.search(r"^fp8: .*$", log_text, re.M)
    row.update({"tokens_per_s": rate(timed),
                "mfu": statistics.fmean(r["mfu"] for r in timed) if "mfu" in timed[0] else None,
                "step_s_median": statistics.median(r["step_time_ms"] for r in timed) / 1000,
                "timed_steps": len(timed), "peak_gpu_gib": max(r.get("memory_gib", 0.0) for r in steps),
                "first_step_s": steps[0]["time"] - started if "time" in steps[0] else None,
                "losses": [round(r["loss"], 5) for r in steps], "converted": converted.group(0) if converted else None,
                "compiled": next((line for line in log_text.splitlines() if line.startswith("compile:")), None)})
    return row


def compare_losses(rows: list[dict]) -> None:
    """Each fp8 row's loss against bf16's, step by step: the mean relative difference, all steps and the last 10."""
    base = next((r for r in rows if r["name"] == "bf16" and "losses" in r), None)
    for row in rows:
        if base is None or row is base or "losses" not in row:
            continue
        pairs = list(zip(row["losses"], base["losses"]))
        rel = [abs(a - b) / b for a, b in pairs]
        row["loss_vs_bf16"] = {"mean_rel_diff": statistics.fmean(rel), "last10_mean_rel_diff": statistics.fmean(rel[-10:]),
                               "last10_mean": statistics.fmean(a for a, _ in pairs[-10:]),
                               "bf16_last10_mean": statistics.fmean(b for _, b in pairs[-10:])}
        row["speed_vs_bf16"] = row["tokens_per_s"] / base["tokens_per_s"] if base.get("tokens_per_s") else None


def table(rows: list[dict]) -> str:
    lines = [f"{'row':16} {'tok/s':>9} {'vs bf16':>8} {'MFU':>6} {'peak GiB':>8} {'1st step s':>10} "
             f"{'loss first>last':>16} {'loss diff (last 10)':>20}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['name']:16} failed: {r['error'].strip().splitlines()[-1][-110:] if r['error'].strip() else ''}")
            continue
        speed = f"{r['speed_vs_bf16']:.2f}x" if r.get("speed_vs_bf16") else ""
        diff = r.get("loss_vs_bf16")
        diff_text = f"{diff['mean_rel_diff']:.2%} ({diff['last10_mean_rel_diff']:.2%})" if diff else ""
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") else "-"
        first = f"{r['first_step_s']:.0f}" if r.get("first_step_s") else "-"
        lines.append(f"{r['name']:16} {r['tokens_per_s']:>9,.0f} {speed:>8} {mfu:>6} {r['peak_gpu_gib']:>8.1f} "
                     f"{first:>10} {r['losses'][0]:>7.3f}>{r['losses'][-1]:<8.3f} {diff_text:>20}")
    return "\n".join(lines)


def plot(result: Path, image: Path) -> None:
    """Each row's loss per step from a results JSON, as torchtitan plots its float8 curves (needs matplotlib)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    doc = json.loads(result.read_text())
    figure, (curves, ratio) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=(3, 1))
    base = next((r["losses"] for r in doc["rows"] if r["name"] == "bf16" and "losses" in r), None)
    for row in doc["rows"]:
        if "losses" not in row:
            continue
        steps = range(1, len(row["losses"]) + 1)
        line, = curves.plot(steps, row["losses"], label=row["name"], linewidth=1)
        if base and row["losses"] is not base:
            ratio.plot(steps, [100 * (a - b) / b for a, b in zip(row["losses"], base)], color=line.get_color(),
                       linewidth=1)
    curves.set_ylabel("training loss")
    curves.set_title(f"{doc['model']['params'] / 1e9:.2f}B Llama-3-8B-shaped, {doc['device']}, {doc['date']}")
    curves.legend()
    ratio.set_ylabel("vs bf16 (%)")
    ratio.set_xlabel("step")
    ratio.axhline(0, color="gray", linewidth=0.5)
    figure.tight_layout()
    figure.savefig(image, dpi=120)
    print(f"written to {image}")


# (full, --tiny) defaults; micro batch 2: the 2.88B model, its optimizer and activations fit an H100's 80 GB
DEFAULTS = {"layers": (12, 4), "steps": (100, 4), "warmup": (10, 1), "seq_len": (2048, 128), "micro_batch": (2, 2),
            "row_timeout": (570.0, 570.0), "budget": (570.0, 570.0)}


def main() -> None:
    if sys.argv[1:2] == ["plot"]:  # python3 benchmarks/fp8.py plot RESULT.json OUT.png
        plot(Path(sys.argv[2]), Path(sys.argv[3]))
        return
    parser = bench_parser(__doc__, DEFAULTS)
    parser.add_argument("--stage", type=int, choices=(2, 3), default=2, help="ZeRO stage (preset stage2/stage3)")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs of each row's `dstrain run` (ZeRO over them)")
    args = bench_args(parser, DEFAULTS, "fp8")
    tiny = args.tiny
    device = device_name(not tiny)
    gpu = short_name(device)
    log(f"work {args.work}; out {args.out}; torchao: {install_wheels('torchao-*.whl', ('torchao',))}")
    model_dir = args.work / "model"
    facts = reuse_or_make_llama(model_dir, dict(LLAMA_TINY if tiny else LLAMA3_8B_LAYER, num_hidden_layers=args.layers),
                                tokenizer_vocab=(LLAMA_TINY if tiny else LLAMA3_8B_LAYER)["vocab_size"],
                                text_chars=6_000_000 if args.layers > 4 else 1_000_000)
    if not (model_dir / "corpus.txt").exists():  # the rows' data: dstrain's corpus as one text file
        from make_instruction_data import corpus_text
        (model_dir / "corpus.txt").write_text(corpus_text())
    doc = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": device,
           "versions": versions_in_child(), "model": facts, "settings": {k: str(v) for k, v in vars(args).items()},
           "rows": []}
    planned = pick([{"name": name, "sets": sets} for name, sets in ROWS], args.rows)

    def describe(row: dict) -> str:
        return (f"{row['tokens_per_s']:,.0f} tok/s, peak {row['peak_gpu_gib']:.1f} GiB, loss {row['losses'][0]} -> "
                f"{row['losses'][-1]}, {row['wall_s']}s; {row['converted']}")
    run_rows(planned, lambda spec: dstrain_row(spec["name"], spec["sets"], {"model": model_dir}, args), describe, doc,
             args.out / f"fp8-{gpu}{f'x{args.gpus}' if args.gpus > 1 else ''}.json", args, after=compare_losses)
    print("\n" + table(doc["rows"]), flush=True)


if __name__ == "__main__":
    main()
