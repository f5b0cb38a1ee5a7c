"""Peak memory and tokens/s of a large-vocabulary model's training step, LM loss whole against chunked
(train.loss_chunking, dstrain/models/chunked_loss.py), in plain PyTorch on one device: no DeepSpeed, so
the difference is the loss alone.

The model: a Qwen2.5-1.5B-shaped Hugging Face Qwen2 built from its config with random weights (hidden
1536, 28 layers, 12 heads, 2 KV heads, intermediate 8960, vocabulary 151,936, tied embeddings, sdpa),
wrapped in dstrain's CausalLM exactly as an `hf:` model trains (dstrain.models.hf.CausalLM): "whole" is
the model's own forward with labels (transformers' lm_head + ForCausalLMLoss, the reference), "chunked"
is the decoder body + dstrain's chunked head. Each variant runs in a fresh process (its own peak).

Precision, as benchmarks/suite.py's torch runner: fp32 weights under autocast bf16 (--weights fp32, the
default) or bf16 weights (--weights bf16). --step adamw adds torch's AdamW step (fused on CUDA) to each
iteration, as training does; --step none times forward + backward alone.

Measured per variant: peak_gib (torch.cuda.max_memory_allocated over the whole run), tokens_per_s (the
median over --steps timed iterations after --warmup, the device synchronised around each), loss_step1
(the first iteration's loss: the two variants must agree, same weights and batch), the relative
difference of the loss to the whole-logits row, and host_rss_gib (the process's peak resident set: the
memory figure of a CPU run).

    python3 benchmarks/large_vocab.py                       # one GPU: the Qwen2.5-1.5B shape, micro 4 x 1024
    python3 benchmarks/large_vocab.py --micro-batch 8 --chunk 2048
    python3 benchmarks/large_vocab.py --tiny --device cpu   # CPU smoke check of the script (seconds)

Writes a table to stdout and JSON to --out (default benchmarks/results/large_vocab-<date>.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

QWEN2_5_1_5B = dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                    intermediate_size=8960, vocab_size=151_936, max_position_embeddings=32_768,
                    tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1_000_000.0)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            vocab_size=8192, max_position_embeddings=256, tie_word_embeddings=True)
VARIANTS = ("whole", "chunked")


def one(args) -> dict:
    """One variant in this process: build, warm up, time; the measurements as a dict."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from dstrain.models.hf import CausalLM
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    shape = TINY if args.tiny else QWEN2_5_1_5B
    config = Qwen2Config(**shape, attn_implementation="sdpa")
    weights = torch.bfloat16 if args.weights == "bf16" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        hf_model = AutoModelForCausalLM.from_config(config, dtype=weights)
    model = CausalLM(hf_model, chunking=args.variant == "chunked", chunk_tokens=args.chunk)
    assert (model.lm_loss is not None) == (args.variant == "chunked"), model.loss_note
    model.train()
    optimizer = (torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda) if args.step == "adamw" else None)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, shape["vocab_size"], (args.micro_batch, args.seq_len), generator=g).to(device)
    batch = {"input_ids": ids, "labels": ids.clone()}  # as dstrain's row sources: labels aligned, model shifts
    autocast = weights == torch.float32 and args.precision == "bf16"

    def iteration() -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(batch)
        loss.backward()
        if optimizer is not None:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True) if optimizer is not None else model.zero_grad(set_to_none=True)
        return loss

    def sync():
        if cuda:
            torch.cuda.synchronize()

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    loss_step1 = float(iteration().item())
    for _ in range(args.warmup - 1):
        iteration()
    times = []
    for _ in range(args.steps):
        sync()
        start = time.perf_counter()
        iteration()
        sync()
        times.append(time.perf_counter() - start)
    tokens = args.micro_batch * args.seq_len
    import resource
    return {"variant": args.variant, "loss_step1": loss_step1,
            "tokens_per_s": tokens / statistics.median(times),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "host_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "step_ms": [round(t * 1e3, 2) for t in times]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny shape (CPU smoke check)")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=1024, help="tokens per chunk (train.loss_chunk_tokens)")
    p.add_argument("--weights", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16", help="autocast bf16 over fp32 weights")
    p.add_argument("--step", choices=("adamw", "none"), default="adamw")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one variant, in a child process
    args = p.parse_args(argv)
    if args.tiny and "--seq-len" not in (argv or sys.argv):
        args.seq_len = 64
    if args.variant:
        print("RESULT " + json.dumps(one(args)), flush=True)
        return 0

    rows = []
    for variant in args.variants.split(","):
        child = [sys.executable, __file__, "--variant", variant, *(argv if argv is not None else sys.argv[1:])]
        done = subprocess.run(child, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))})
        line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
        if done.returncode or line is None:
            rows.append({"variant": variant, "error": (done.stderr or done.stdout).strip().splitlines()[-1:]})
            print(f"{variant}: failed: {rows[-1]['error']}", file=sys.stderr)
            continue
        rows.append(json.loads(line[len("RESULT "):]))
    base = next((r for r in rows if r["variant"] == "whole" and "error" not in r), None)
    print(f"{'variant':8} {'tokens/s':>10} {'vs whole':>8} {'peak GiB':>9} {'vs whole':>8} {'host RSS GiB':>12} "
          f"{'loss step 1':>12} {'rel diff':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:8} failed")
            continue
        if base:
            r["speed_vs_whole"] = r["tokens_per_s"] / base["tokens_per_s"]
            r["peak_vs_whole"] = r["peak_gib"] / base["peak_gib"] if r["peak_gib"] and base["peak_gib"] else None
            r["loss_rel_diff"] = abs(r["loss_step1"] - base["loss_step1"]) / abs(base["loss_step1"])

        def fmt(value, spec):
            return format(value, spec) if value is not None else "-"
        print(f"{r['variant']:8} {r['tokens_per_s']:>10,.0f} {fmt(r.get('speed_vs_whole'), '.3f'):>8} "
              f"{fmt(r['peak_gib'], '.2f'):>9} {fmt(r.get('peak_vs_whole'), '.3f'):>8} {r['host_rss_gib']:>12.2f} "
              f"{r['loss_step1']:>12.6f} "
              f"{fmt(r.get('loss_rel_diff'), '.1e'):>9}")
    import torch
    import transformers
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") and torch.cuda.is_available() else args.device
    report = {"date": datetime.date.today().isoformat(), "device": device_name, "torch": torch.__version__,
              "transformers": transformers.__version__,
              "shape": TINY if args.tiny else QWEN2_5_1_5B, "micro_batch": args.micro_batch, "seq_len": args.seq_len,
              "chunk": args.chunk, "weights": args.weights, "precision": args.precision, "step": args.step,
              "warmup": args.warmup, "steps": args.steps, "rows": rows}
    out = args.out or REPO / "benchmarks" / "results" / f"large_vocab-{report['date']}{'-tiny' if args.tiny else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
