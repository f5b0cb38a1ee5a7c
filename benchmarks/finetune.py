"""GPU benchmark: fine-tuning a ~1.1B Llama-style model (random weights saved locally) with ZeRO-3,
through `dstrain run` on 1 and 2 GPUs, with PyTorch Lightning's DeepSpeedStrategy(stage=3) on the same
model as the peer row, plus the peak host RAM of loading the pretrained weights. One command:

    python3 benchmarks/finetune.py                       # 1 GPU, then 2 if there are two; ~5 minutes on H100
    python3 benchmarks/finetune.py --gpus 1 --steps 30 --json benchmarks/results/2026-11-23-h100-finetune.json

Rows (each a fresh process):
  dstrain    `python -m dstrain.cli run --preset stage3 --gpus N --set model.name=hf:DIR ...`: the real
             launcher; the model is built under zero.Init and the saved weights copied into its partitions.
             tokens/s: median of metrics.jsonl's tokens_per_s over the log intervals after --warmup steps.
  lightning  Lightning's `DeepSpeedStrategy(stage=3)`, precision bf16-mixed, torch AdamW(fused), the same
             model built in configure_model (Lightning's zero.Init hook) from the same config.json. Lightning
             has no sharded loading of Hugging Face weights, so its model keeps its random init (its
             throughput is comparable; its loading is not). Timed like dstrain: intervals between log
             points after --warmup steps, the loss read only there.
  load       benchmarks/hf_load_memory.py through the deepspeed launcher: each rank runs dstrain's build_model
             for ZeRO-3 (and ZeRO-2's from_pretrained per rank, for comparison) and samples its own resident
             memory; the table shows the largest rank's peak RSS and the sum over ranks.

Same data for both trainers: random token ids (dstrain's synthetic source), --seq-len tokens, --micro-batch
sequences per GPU, bf16. The JSON written holds every row, the date, the GPU and the versions.
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


def gpu_count() -> int:
    import torch
    return torch.cuda.device_count()


def dstrain_row(model_dir: Path, gpus: int, args) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        run_dir = Path(scratch) / "run"
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]  # synthetic ids below it
        sets = [f"model.name=hf:{model_dir}", "data.source=synthetic", f"model.vocab_size={vocab}",
                f"data.seq_len={args.seq_len}", f"train.micro_batch_size={args.micro_batch}",
                f"train.max_steps={args.steps}", f"train.log_every={args.log_every}", "train.save_checkpoints=false",
                "train.eval_every=1000000", "train.eval_batches=1", "train.warmup_steps=2", "train.lr=1e-5",
                *(args.set or [])]
        command = [sys.executable, "-m", "dstrain.cli", "run", "--preset", "stage3", "--gpus", str(gpus),
                   "--run-dir", str(run_dir)]
        for item in sets:
            command += ["--set", item]
        started = time.perf_counter()
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        wall = time.perf_counter() - started
        if done.returncode:
            return {"runner": "dstrain", "gpus": gpus, "error": (done.stdout + done.stderr)[-3000:]}
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        speeds = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r and r["step"] - args.log_every >= args.warmup]
        losses = [r["loss"] for r in rows if "loss" in r]
        peak_gpu = max((r["memory_gib"] for r in rows if "memory_gib" in r), default=None)
    return {"runner": "dstrain", "gpus": gpus, "tokens_per_s": statistics.median(speeds), "intervals": len(speeds),
            "first_loss": losses[0], "last_loss": losses[-1], "wall_s": wall, "peak_gpu_gib": peak_gpu,
            "sets": args.set or []}


def lightning_row(model_dir: Path, gpus: int, args) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        result = Path(scratch) / "result.json"
        command = [sys.executable, __file__, "lightning-child", "--model-dir", str(model_dir), "--gpus", str(gpus),
                   "--steps", str(args.steps), "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch),
                   "--log-every", str(args.log_every), "--warmup", str(args.warmup), "--result", str(result)]
        started = time.perf_counter()
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        wall = time.perf_counter() - started
        if done.returncode or not result.exists():
            return {"runner": "lightning", "gpus": gpus, "error": (done.stdout + done.stderr)[-3000:]}
        row = json.loads(result.read_text())
    return {"runner": "lightning", "gpus": gpus, **row, "wall_s": wall}


def lightning_child(args) -> None:
    """Runs inside Lightning's processes (Lightning starts one per GPU from this command)."""
    import lightning as L
    import torch
    import torch.nn.functional as F
    from lightning.pytorch.strategies import DeepSpeedStrategy
    from torch.utils.data import DataLoader, Dataset
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(args.model_dir)
    steps, micro, seq = args.steps, args.micro_batch, args.seq_len

    class Tokens(Dataset):
        def __len__(self):
            return steps * micro

        def __getitem__(self, index):
            window = torch.randint(0, config.vocab_size, (seq + 1,), generator=torch.Generator().manual_seed(index))
            return window[:-1], window[1:]

    class FineTune(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = None

        def configure_model(self):
            if self.model is None:
                self.model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)

        def training_step(self, batch, _index):
            inputs, targets = batch
            logits = self.model(input_ids=inputs, use_cache=False).logits
            return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.model.parameters(), lr=1e-5, weight_decay=0.0, fused=True)

    class Intervals(L.Callback):
        def __init__(self):
            self.speeds, self.start, self.steps, self.loss = [], None, 0, None

        def on_train_batch_start(self, trainer, module, batch, index):
            if self.start is None:
                self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, index):
            self.steps += 1
            if (index + 1) % args.log_every == 0:
                self.loss = outputs["loss"].item()  # the only device sync, as in dstrain's loop
                seconds = time.perf_counter() - self.start
                if index + 1 - args.log_every >= args.warmup:
                    self.speeds.append(self.steps * micro * seq * trainer.world_size / seconds)
                self.start, self.steps = time.perf_counter(), 0

    timer = Intervals()
    trainer = L.Trainer(accelerator="gpu", devices=args.gpus, strategy=DeepSpeedStrategy(stage=3),
                        precision="bf16-mixed", max_steps=steps, callbacks=[timer], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=True, num_sanity_val_steps=0, gradient_clip_val=1.0)
    trainer.fit(FineTune(), train_dataloaders=DataLoader(Tokens(), batch_size=micro, num_workers=1))
    if trainer.global_rank == 0:
        Path(args.result).write_text(json.dumps({
            "tokens_per_s": statistics.median(timer.speeds), "intervals": len(timer.speeds), "last_loss": timer.loss,
            "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30}))


def load_rows(model_dir: Path, gpus: int) -> list[dict]:
    import torch
    from hf_load_memory import measure
    accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    return [{"runner": f"load {r['preset']}", "gpus": gpus, **r}
            for r in measure(model_dir, gpus, ["stage3", "stage2"], accelerator)]



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", default="bench", choices=["bench", "lightning-child"])
    parser.add_argument("--gpus", default=None, help="comma-separated GPU counts (default: 1, and 2 if present)")
    parser.add_argument("--model-dir", type=Path, default=None, help="reuse a saved model (default: make one)")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--no-lightning", action="store_true")
    parser.add_argument("--set", action="append", help="extra dstrain override for the dstrain rows")
    parser.add_argument("--no-load", action="store_true", help="skip the host-RAM-of-loading rows")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--result", type=Path, default=None)
    args, _ = parser.parse_known_args()
    if args.command == "lightning-child":
        args.gpus = int(args.gpus)
        lightning_child(args)
        return

    counts = [int(g) for g in args.gpus.split(",")] if args.gpus else [g for g in (1, 2) if g <= gpu_count()]
    model_dir = args.model_dir
    if model_dir is None:
        from hf_load_memory import make
        model_dir = Path(tempfile.mkdtemp(prefix="dstrain-llama-1b-"))
        make(model_dir, None)
    rows = []

    def keep(new: list[dict]) -> None:  # printed as it comes: a later row that crashes loses nothing
        for row in new:
            print("row " + json.dumps(row), flush=True)
        rows.extend(new)
    for gpus in counts:
        keep([dstrain_row(model_dir, gpus, args)])
        if not args.no_lightning:
            keep([lightning_row(model_dir, gpus, args)])
    if not args.no_load:
        try:
            keep(load_rows(model_dir, max(counts)))
        except Exception as err:  # noqa: BLE001 - the speed rows above still get written
            keep([{"runner": "load", "gpus": max(counts), "error": f"{type(err).__name__}: {err}"}])

    print(f"\n{'runner':14} {'GPUs':>4} {'tokens/s':>10} {'vs lightning':>12} {'peak host RAM of loading':>26}")
    for row in rows:
        if "error" in row:
            print(f"{row['runner']:14} {row['gpus']:>4} failed: {row['error'][-300:]}")
            continue
        peer = next((r for r in rows if r["runner"] == "lightning" and r["gpus"] == row["gpus"]
                     and "tokens_per_s" in r), None)
        ratio = f"{row['tokens_per_s'] / peer['tokens_per_s']:.3f}" if peer and "tokens_per_s" in row else ""
        speed = f"{row['tokens_per_s']:,.0f}" if "tokens_per_s" in row else ""
        memory = (f"rank max {row['max_rank_peak_rss_gib']:.2f} GiB, sum {row['sum_peak_rss_gib']:.2f} GiB"
                  if "max_rank_peak_rss_gib" in row else "")
        print(f"{row['runner']:14} {row['gpus']:>4} {speed:>10} {ratio:>12} {memory:>26}")
    if args.json:
        write_json(args.json, vars(args), rows)


if __name__ == "__main__":
    main()
