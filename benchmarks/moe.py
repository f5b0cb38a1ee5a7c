"""GPU benchmark: training a mixture-of-experts model (issue 53, item 4), dstrain against Accelerate with the
same DeepSpeed config, on 2 and 4 GPUs. Run on 2 H200s (2026-11-28, docs/benchmarks.md); not yet on 4. Needs
transformers >= 5.24 (the ZeRO-3 MoE loader's conversions): on the device machine install the carried
.whl/tf524 wheel into /tmp/site after sourcing benchmarks/gpu_env.sh.

    source benchmarks/gpu_env.sh && python3 benchmarks/moe.py --gpus 2 4 --out $OUT     # ~25 min on H100s
    python3 benchmarks/moe.py --gpus 2 --rows dstrain-z3 --out /tmp/o                     # one row
    python3 benchmarks/moe.py --tiny --accelerator cpu --gpus 2 --rows dstrain-z3 --out /tmp/o   # CPU smoke

The model (built in --work once, reused): a Qwen3-MoE block as in Qwen3-30B-A3B (hidden 2048, 32 query and
4 key/value heads of 128, 128 experts of intermediate 768, top 8, vocabulary 151,936) with 16 layers instead of
48: 10.6B parameters held, 1.5B run per token. Random bf16 weights written by save_pretrained, so the folder
has the published per-expert layout that dstrain's ZeRO-3 loader converts (transformers' own mapping).

Rows, each a fresh process, data.seq_len --seq-len, --micro-batch rows per GPU, bf16, --steps steps:
  dstrain-z3, dstrain-z2 (where it fits)
      `python -m dstrain.cli run --preset stage3|stage2 --gpus N --set model.name=hf:DIR --set data.source=synthetic`;
      tokens/s: median of metrics.jsonl's tokens_per_s over the log intervals after --warmup steps; MFU from
      metrics.jsonl, which counts the active parameters (6 x active parameters per token + attention).
  accelerate-z3
      `accelerate launch` (DeepSpeed plugin, zero3_init_flag) of a plain loop: from_pretrained under zero.Init,
      the optimizer and scheduler of the DeepSpeed JSON dstrain-z3 ran with (the run directory's
      ds_config.json, so ZeRO's settings are the same), random token ids, loss.backward / step, timed between
      synchronised points after --warmup steps; MFU counted as dstrain counts it.

Reported per row: tokens_per_s, mfu, peak GPU memory, first and last loss, wall time, the error tail of a failed
row; --out gets moe-<gpu>.json (rows, date, GPU, versions, settings) and each row's log. The target of the
issue: dstrain-z3 >= 1.5 x accelerate-z3 at equal GPUs, spread under 5% (--repeat 3 gives the spread).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

SHAPE = dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=4,
             head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
             max_position_embeddings=4096, tie_word_embeddings=False)
TINY = dict(SHAPE, vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=128, moe_intermediate_size=32, num_experts=16, num_experts_per_tok=4)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def make_model(directory: Path, tiny: bool, accelerator: str) -> Path:
    """The random MoE model's folder (built on the GPU in bf16 where there is one; reused when there)."""
    if (directory / "config.json").is_file():
        return directory
    import torch
    import transformers
    config = transformers.Qwen3MoeConfig(**(TINY if tiny else SHAPE))
    device = "cuda" if accelerator == "cuda" else "cpu"
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    del model
    if device == "cuda":  # else this process keeps the model's memory cached on GPU 0 while the rows run
        torch.cuda.empty_cache()  # (seen: 32 GiB held, the micro batch 2 rows ran out of memory)
    return directory


def counts(model_dir: Path) -> dict:
    """Total and active parameters and the training FLOPs per token, as dstrain counts them (meta device)."""
    import torch
    import transformers

    from dstrain.models.moe import inactive_parameters
    config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    active = total - inactive_parameters(model)
    return {"total_params": total, "active_params": active,
            "lookup_params": model.get_input_embeddings().weight.numel(),
            "layers": config.num_hidden_layers, "hidden": config.hidden_size}


def flops_per_token(c: dict, seq_len: int) -> float:
    return 6.0 * (c["active_params"] - c["lookup_params"]) + 12.0 * c["layers"] * c["hidden"] * seq_len


def run_logged(command: list[str], log_path: Path, timeout: float, env: dict | None = None) -> tuple[int, float, str]:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(log_path, "w") as out:
        try:
            code = subprocess.run(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, timeout=timeout,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}).returncode
        except subprocess.TimeoutExpired:
            code = 124
    return code, time.perf_counter() - started, log_path.read_text(errors="replace")[-3000:]


def dstrain_row(stage: int, gpus: int, model_dir: Path, args, run_dir: Path) -> dict:
    row = {"name": f"dstrain-z{stage}", "gpus": gpus}
    shutil.rmtree(run_dir, ignore_errors=True)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    sets = [f"model.name=hf:{model_dir}", "data.source=synthetic", f"model.vocab_size={vocab}",
            f"data.seq_len={args.seq_len}", f"train.micro_batch_size={args.micro_batch}",
            f"train.max_steps={args.steps}", f"train.log_every={args.log_every}", "train.save_checkpoints=false",
            "train.eval_every=1000000", "train.eval_batches=1", "train.warmup_steps=2", "train.lr=1e-5",
            *(args.set or [])]
    command = [sys.executable, "-m", "dstrain.cli", "run", "--preset", f"stage{stage}", "--gpus", str(gpus),
               "--accelerator", args.accelerator, "--run-dir", str(run_dir)]
    for item in sets:
        command += ["--set", item]
    code, wall, tail = run_logged(command, args.out / "logs" / f"{row['name']}-g{gpus}.log", args.row_limit)
    row.update(wall_s=round(wall, 1), command=" ".join(command))
    metrics = run_dir / "metrics.jsonl"
    if code or not metrics.is_file():
        return {**row, "error": f"exit {code}: {tail}"}
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    timed = [r for r in rows if "tokens_per_s" in r and r["step"] - args.log_every >= args.warmup]
    losses = [r["loss"] for r in rows if "loss" in r]
    row.update(tokens_per_s=statistics.median(r["tokens_per_s"] for r in timed),
               mfu=statistics.median(r["mfu"] for r in timed) if timed and "mfu" in timed[0] else None,
               expert_load=timed[-1].get("expert_load") if timed else None,
               peak_gpu_gib=max((r["memory_gib"] for r in rows if "memory_gib" in r), default=None),
               first_loss=losses[0], last_loss=losses[-1], intervals=len(timed))
    return row


def accelerate_row(gpus: int, model_dir: Path, args, ds_config: Path, c: dict) -> dict:
    row = {"name": "accelerate-z3", "gpus": gpus}
    where = args.work / "runs" / f"accelerate-g{gpus}"
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    config = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "DEEPSPEED",
              "deepspeed_config": {"deepspeed_config_file": str(ds_config), "zero3_init_flag": True},
              "machine_rank": 0, "num_machines": 1, "num_processes": gpus, "rdzv_backend": "static",
              "same_network": True, "use_cpu": args.accelerator == "cpu"}
    (where / "accelerate.yaml").write_text(json.dumps(config, indent=2))  # JSON is YAML
    spec = {"model": str(model_dir), "seq_len": args.seq_len, "micro_batch": args.micro_batch, "steps": args.steps,
            "warmup": args.warmup, "result": str(where / "result.json"), "cuda": args.accelerator == "cuda"}
    (where / "spec.json").write_text(json.dumps(spec))
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(where / "accelerate.yaml"),
               str(Path(__file__).resolve()), "accelerate-child", "--spec", str(where / "spec.json")]
    code, wall, tail = run_logged(command, args.out / "logs" / f"accelerate-z3-g{gpus}.log", args.row_limit)
    row.update(wall_s=round(wall, 1), command=" ".join(command), ds_config=json.loads(ds_config.read_text()))
    if code or not (where / "result.json").is_file():
        return {**row, "error": f"exit {code}: {tail}"}
    row.update(json.loads((where / "result.json").read_text()))
    from dstrain.hardware import dense_bf16_peak_tflops
    peak = dense_bf16_peak_tflops(row.get("device", "")) if args.accelerator == "cuda" else None
    row["mfu"] = row["tokens_per_s"] * flops_per_token(c, args.seq_len) / gpus / 1e12 / peak if peak else None
    return row


def accelerate_child(spec_path: Path) -> None:
    """Inside accelerate's processes: a plain DeepSpeed ZeRO-3 training loop as an Accelerate user writes it."""
    import torch
    import transformers
    from accelerate import Accelerator
    from accelerate.utils import DummyOptim, DummyScheduler

    spec = json.loads(spec_path.read_text())
    accelerator = Accelerator()
    plugin = accelerator.state.deepspeed_plugin
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.bfloat16)
    ds = plugin.deepspeed_config
    optimizer = (DummyOptim(model.parameters(), lr=1e-5) if "optimizer" in ds
                 else torch.optim.AdamW(model.parameters(), lr=1e-5))
    scheduler = DummyScheduler(optimizer) if "scheduler" in ds else None
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(accelerator.process_index)
    batches = [torch.randint(0, vocab, (spec["micro_batch"], spec["seq_len"]), generator=generator)
               for _ in range(8)]
    prepared = accelerator.prepare(model, optimizer, *([scheduler] if scheduler else []))
    model, optimizer = prepared[0], prepared[1]
    sync = torch.cuda.synchronize if spec["cuda"] else (lambda: None)
    losses, started = [], None
    for step in range(spec["steps"]):
        if step == spec["warmup"]:
            sync()
            started = time.perf_counter()
        ids = batches[step % len(batches)].to(accelerator.device)
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step in (0, spec["steps"] - 1):
            losses.append(loss.item())
    sync()
    elapsed = time.perf_counter() - started
    tokens = (spec["steps"] - spec["warmup"]) * spec["micro_batch"] * spec["seq_len"] * accelerator.num_processes
    if accelerator.is_main_process:
        Path(spec["result"]).write_text(json.dumps({
            "tokens_per_s": tokens / elapsed, "first_loss": losses[0], "last_loss": losses[-1],
            "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if spec["cuda"] else None,
            "device": torch.cuda.get_device_name() if spec["cuda"] else "cpu"}))


def table(rows: list[dict]) -> str:
    lines = ["| row | GPUs | tokens/s | MFU (active) | peak GPU GiB | loss first -> last | wall s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | {r['gpus']} | error: {r['error'].splitlines()[-1][:80] if r['error'] else ''} "
                         "| | | | |")
            continue
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") else "-"
        gib = f"{r['peak_gpu_gib']:.1f}" if r.get("peak_gpu_gib") else "-"
        lines.append(f"| {r['name']} | {r['gpus']} | {r['tokens_per_s']:,.0f} | {mfu} | {gib} | "
                     f"{r['first_loss']:.3f} -> {r['last_loss']:.3f} | {r['wall_s']} |")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "accelerate-child":
        accelerate_child(Path(sys.argv[sys.argv.index("--spec") + 1]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rows", nargs="+", default=["dstrain-z3", "dstrain-z2", "accelerate-z3"])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=1, help="runs of each row, for the spread")
    parser.add_argument("--set", action="append", help="extra --set for the dstrain rows")
    parser.add_argument("--work", type=Path, default=Path("/tmp/dstrain-moe"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--row-limit", type=float, default=900, help="seconds before a row is stopped")
    parser.add_argument("--accelerator", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="a tiny model (smoke runs)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = make_model(args.work / ("moe-tiny" if args.tiny else "moe-10b"), args.tiny, args.accelerator)
    c = counts(model_dir)
    log(f"model {model_dir}: {c['total_params'] / 1e9:.2f}B parameters, {c['active_params'] / 1e9:.2f}B active")
    rows = []
    for gpus in args.gpus:
        ds_config = None
        for _ in range(args.repeat):
            for name in args.rows:
                log(f"{name} on {gpus} GPU(s)")
                if name.startswith("dstrain-z"):
                    stage = int(name[-1])
                    run_dir = args.work / "runs" / f"{name}-g{gpus}"
                    rows.append(dstrain_row(stage, gpus, model_dir, args, run_dir))
                    if stage == 3 and (run_dir / "ds_config.json").is_file():
                        ds_config = args.work / f"ds_config-g{gpus}.json"
                        shutil.copyfile(run_dir / "ds_config.json", ds_config)
                elif name == "accelerate-z3":
                    if ds_config is None:
                        rows.append({"name": name, "gpus": gpus, "error": "needs dstrain-z3's ds_config.json first"})
                    else:
                        rows.append(accelerate_row(gpus, model_dir, args, ds_config, c))
                log(json.dumps({k: v for k, v in rows[-1].items() if k not in ("ds_config", "command")})[:400])
    print(table(rows))
    from run_record import write_json
    import torch
    gpu = torch.cuda.get_device_name().replace(" ", "-").lower() if torch.cuda.is_available() else "cpu"
    write_json(args.out / f"moe-{gpu}.json", {**vars(args), "work": str(args.work), "out": str(args.out), **c}, rows)


if __name__ == "__main__":
    main()
