"""Rank 0's view of training: metrics.jsonl (one JSON object per logged step) and the console.

On a terminal the console shows a rich progress bar with step, loss, lr, tokens/s, TFLOP/s and
device memory; otherwise (CI, pipes, log files) one plain line per logged step.
"""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


def device_memory_gib(device: torch.device) -> float:
    """Peak device memory (GPU), or peak resident host memory for CPU ranks, in GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


class MetricsLog:
    def __init__(self, run_dir: Path, enabled: bool, max_steps: int, tokens_per_step: int,
                 flops_per_token: float, world: int, device: torch.device):
        self.enabled = enabled
        self.max_steps = max_steps
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.world = world
        self.device = device
        self.console = Console(highlight=False)
        self.file = open(run_dir / "metrics.jsonl", "a") if enabled else None
        self.progress: Progress | None = None
        self.task = None
        self.last_loss: float | None = None

    def start(self, step: int) -> None:
        if not self.enabled or not self.console.is_terminal:
            return
        self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[info]}"), TimeRemainingColumn(), console=self.console)
        self.task = self.progress.add_task("train", total=self.max_steps, completed=step, info="")
        self.progress.start()

    def _write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def log_step(self, step: int, loss: float, lr: float, elapsed: float, steps: int) -> None:
        if not self.enabled:
            return
        tokens_per_s = self.tokens_per_step * steps / max(elapsed, 1e-9)
        tflops = tokens_per_s * self.flops_per_token / self.world / 1e12
        mem = device_memory_gib(self.device)
        self.last_loss = loss
        self._write({"step": step, "loss": loss, "lr": lr, "tokens_per_s": tokens_per_s,
                     "tflops_per_device": tflops, "memory_gib": mem, "time": time.time()})
        info = f"loss {loss:.4f}  lr {lr:.2e}  {tokens_per_s:,.0f} tok/s  {tflops:.2f} TFLOP/s  mem {mem:.2f} GiB"
        if self.progress is not None:
            self.progress.update(self.task, completed=step, info=info)
        else:
            self.console.print(f"step {step}/{self.max_steps}  {info}", soft_wrap=True)

    def log_eval(self, step: int, loss: float) -> None:
        if not self.enabled:
            return
        self._write({"step": step, "eval_loss": loss, "time": time.time()})
        self.note(f"step {step}: eval loss {loss:.4f}")

    def note(self, text: str) -> None:
        if self.enabled:
            (self.progress.console if self.progress else self.console).print(f"[dim]{text}[/]")

    def finish(self, state, saved_checkpoint: bool = True) -> None:
        if not self.enabled:
            return
        if self.progress is not None:
            self.progress.stop()
        if state.stopped_by:
            saved = ("checkpoint saved (continue with --resume latest)" if saved_checkpoint
                     else "no checkpoint saved (train.save_checkpoints is false)")
            self.console.print(f"stopped by {state.stopped_by} at step {state.step}; {saved}")
        self.file.close()
