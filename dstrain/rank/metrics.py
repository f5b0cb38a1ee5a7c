"""Rank 0's view of training: metrics.jsonl (one JSON object per logged step, evaluation or event), the
trackers of `train.log_to` (dstrain/rank/trackers.py) and the console.

On a terminal the console shows a rich progress bar with the ETA, loss, tokens/s and MFU; otherwise
(CI, pipes, log files) one plain line per logged step. Everything here runs at log steps, which the
loop already waits for the device at; nothing is read from the device between them.

metrics.jsonl rows: training rows (step, loss, lr, grad_norm, tokens_per_s (every position of every
row, padding included), real_tokens_per_s (non-pad tokens only; absent for a user's Dataset), tflops_per_device, mfu,
data_wait_ms, step_time_ms, memory_gib, gpu_mem_allocated_gib, gpu_mem_reserved_gib, host_rss_gib,
loss_scale, skipped_steps, time; with a preference objective TRL's rewards/chosen, rewards/rejected,
rewards/accuracies, rewards/margins, logps/chosen, logps/rejected and the objective's own: nll_loss,
log_odds_ratio, log_odds_chosen, kl; with a mixture-of-experts model expert_load, expert_tokens (a list) and,
where its router's balancing loss counts, lm_loss and aux_loss: dstrain/models/moe.py), evaluation rows (eval_ before the preference names) (step, eval_loss, eval_samples, eval_examples,
eval_split_samples, time: what the evaluation covered, each sample once) and event rows ({"event":
kind, "step": ...}): "run_start" and "run_end" bracket each session of a run (dstrain/run_summary.py
reads them), other kinds come from `log_event` (rollbacks, say). Keys a run cannot measure are absent:
mfu and gpu_mem_* on CPU, loss_scale and skipped_steps without fp16, grad_norm where DeepSpeed keeps
none (see `engine_stats`).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from dstrain import rundir
from dstrain.console_text import outside
from dstrain.hardware import dense_bf16_peak_tflops


def device_memory_gib(device: torch.device) -> float:
    """Peak device memory (GPU), or peak resident host memory for CPU ranks, in GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


def host_rss_gib() -> float:
    """This process's resident host memory now, in GiB (from /proc: no system call per page)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def engine_stats(engine) -> dict[str, float]:
    """What the engine knows about its last optimizer step: the global gradient norm before clipping,
    and with fp16 the loss scale and the steps skipped for overflow. Call it at log steps only: the
    norm is a device tensor under ZeRO, and reading it waits for the device.

    engine.get_global_grad_norm() in DeepSpeed 0.19.8 (read in its source, checked on CPU ranks):
    ZeRO 1/2 (DeepSpeedZeroOptimizer) and ZeRO 3 return a 0-dim device tensor, the norm over all ranks
    before clipping (inf after an fp16 overflow); None under ZeRO 1/2 with
    zero_optimization.compute_grad_norm false. Stage 0 returns a float in bf16/fp16 (DeepSpeed's
    bf16/fp16 optimizer wrappers) and None in fp32, where the engine clips with torch's
    clip_grad_norm_ and drops the norm: that one combination logs no grad_norm."""
    stats: dict[str, float] = {}
    norm = engine.get_global_grad_norm()
    if norm is not None:
        stats["grad_norm"] = float(norm)
    if engine.fp16_enabled():
        scale = getattr(engine.optimizer, "cur_scale", None)  # every DeepSpeed fp16 optimizer has it
        if scale is not None:
            stats["loss_scale"] = float(scale)
        stats["skipped_steps"] = int(engine.skipped_steps)
    return stats


BAR_WIDTH = 12
# fields of the live bar, most needed first: loss, a preference objective's rewards, throughput, memory, the rest
_FIT_ORDER = (0, 6, 3, 5, 1, 4, 2)


def _fit(fields: list[str], budget: int) -> str:
    """The fields that fit `budget` characters, joined by two spaces, in their own order; the most needed
    (_FIT_ORDER) are kept first."""
    kept: set[int] = set()
    for index in _FIT_ORDER:
        if fields[index] and len("  ".join(fields[i] for i in sorted(kept | {index}))) <= budget:
            kept.add(index)
    return "  ".join(fields[i] for i in sorted(kept))


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def _preference_field(v: dict[str, float]) -> str:
    """A preference objective's rewards on the console line: accuracy, margin (and KTO's KL); '' for lm. A
    reward model logs them as "accuracy" and "margin" (reward_loss's names)."""
    parts = []
    accuracy, margin = v.get("rewards/accuracies", v.get("accuracy")), v.get("rewards/margins", v.get("margin"))
    if accuracy is not None:
        parts.append(f"acc {accuracy:.0%}")
    if margin is not None:
        parts.append(f"margin {margin:.3g}")
    if "kl" in v:
        parts.append(f"kl {v['kl']:.3g}")
    return " ".join(parts)


class MetricsLog:
    def __init__(self, run_dir: Path, enabled: bool, max_steps: int, tokens_per_step: int,
                 flops_per_token: float, world: int, device: torch.device, trackers: list | None = None):
        self.enabled = enabled
        self.max_steps = max_steps
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.world = world
        self.device = device
        self.device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        self.peak_tflops = dense_bf16_peak_tflops(self.device_name) if device.type == "cuda" else None
        self.console = Console(highlight=False)
        self.file = open(run_dir / rundir.METRICS, "a") if enabled else None
        self.trackers = list(trackers or []) if enabled else []
        self.progress: Progress | None = None
        self.task = None
        self.last_loss: float | None = None
        self.run_facts: dict[str, Any] = {}  # written into each run_start event (the data's packing, say)

    def start(self, step: int) -> None:
        if not self.enabled:
            return
        self._write({"event": "run_start", "step": step, "max_steps": self.max_steps, "world_size": self.world,
                     "device": self.device_name, "peak_tflops": self.peak_tflops,
                     "tokens_per_step": self.tokens_per_step, **self.run_facts, "time": time.time()})
        if not self.console.is_terminal:
            return
        self.progress = Progress(TextColumn("[bold]train"), BarColumn(bar_width=BAR_WIDTH), MofNCompleteColumn(),
                                 TextColumn("{task.fields[info]}"), TextColumn("eta"), TimeRemainingColumn(),
                                 console=self.console)
        self.task = self.progress.add_task("train", total=self.max_steps, completed=step, info="")
        self.progress.start()

    def _write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def _to_trackers(self, call: str, *args) -> None:
        """A tracker that fails (full disk, W&B service gone) is dropped with a warning: metrics.jsonl
        stays the record, and a week-long run does not die of its dashboard."""
        for tracker in list(self.trackers):
            method = getattr(tracker, call, None)
            if method is None:  # a user's tracker without the optional rewind
                continue
            try:
                method(*args)
            except Exception as err:  # noqa: BLE001 - any library error; named in the warning
                self.trackers.remove(tracker)
                print(f"warning: tracker {getattr(tracker, 'name', type(tracker).__name__)} failed and is switched off for the rest of the run: "
                      f"{type(err).__name__}: {err}", file=sys.stderr)

    def log_step(self, step: int, loss: float, lr: float, elapsed: float, steps: int, data_s: float = 0.0,
                 stats: dict[str, float] | None = None, real_tokens: int | None = None) -> None:
        """One log interval of `steps` steps that took `elapsed` s, `data_s` of them building batches on
        the host; `stats` from `engine_stats`; `real_tokens`: the non-pad tokens of those steps."""
        if not self.enabled:
            return
        elapsed = max(elapsed, 1e-9)
        tokens_per_s = self.tokens_per_step * steps / elapsed
        tflops = tokens_per_s * self.flops_per_token / self.world / 1e12
        values: dict[str, float] = {"loss": loss, "lr": lr, **(stats or {}), "tokens_per_s": tokens_per_s}
        if real_tokens is not None:
            values["real_tokens_per_s"] = real_tokens / elapsed
        values["tflops_per_device"] = tflops
        if self.peak_tflops:
            values["mfu"] = tflops / self.peak_tflops
        values["data_wait_ms"] = 1000 * data_s / steps
        values["step_time_ms"] = 1000 * elapsed / steps
        values["memory_gib"] = device_memory_gib(self.device)
        if self.device.type == "cuda":
            values["gpu_mem_allocated_gib"] = torch.cuda.memory_allocated(self.device) / 2**30
            values["gpu_mem_reserved_gib"] = torch.cuda.memory_reserved(self.device) / 2**30
        values["host_rss_gib"] = host_rss_gib()
        self.last_loss = loss
        self._write({"step": step, **values, "time": time.time()})
        # lists (a MoE model's expert_tokens) are for metrics.jsonl: trackers draw numbers
        self._to_trackers("log_metrics", step, {k: v for k, v in values.items() if not isinstance(v, list)})
        self._show(step, values, eta_s=(self.max_steps - step) * elapsed / steps)

    def _show(self, step: int, v: dict[str, float], eta_s: float) -> None:
        tokens = f"{v['tokens_per_s']:,.0f} tok/s"
        if "real_tokens_per_s" in v and v["real_tokens_per_s"] < v["tokens_per_s"]:
            tokens += f" ({v['real_tokens_per_s']:,.0f} real)"
        loss = f"loss {v['loss']:.4f}" + (f" (aux {v['aux_loss']:.3g})" if "aux_loss" in v else "")
        fields = [loss, f"lr {v['lr']:.2e}",
                  f"gnorm {v['grad_norm']:.3g}" if "grad_norm" in v else "", tokens,
                  f"MFU {v['mfu']:.1%}" if "mfu" in v else f"{v['tflops_per_device']:.2f} TFLOP/s",
                  f"mem {v['memory_gib']:.2f} GiB", _preference_field(v)]
        if self.progress is not None:
            # the live bar is one line: what does not fit the terminal goes, least needed first
            steps = len(str(self.max_steps))
            budget = self.console.width - (BAR_WIDTH + 2 * steps + 24)  # "train", "/", "eta 0:00:00", spaces, spare
            self.progress.update(self.task, completed=step, info=_fit(fields, budget))
        else:
            info = "  ".join(f for f in fields if f)
            self.console.print(f"step {step}/{self.max_steps}  {info}  eta {_duration(eta_s)}", soft_wrap=True)

    def log_eval(self, step: int, loss: float, covered: dict[str, Any] | None = None, what: str = "") -> None:
        """An evaluation's loss; `covered`: how many held-out samples and examples (eval_samples, ...)."""
        if not self.enabled:
            return
        self._write({"step": step, "eval_loss": loss, **(covered or {}), "time": time.time()})
        self._to_trackers("log_metrics", step, {"eval_loss": loss})
        self.note(f"step {step}: eval loss {loss:.4f}" + (f" over {what}" if what else ""))

    def log_event(self, kind: str, step: int, **fields: Any) -> None:
        """An event (a rollback, say): {"event": kind, "step": step, **fields} in metrics.jsonl, and an
        event in every tracker (TensorBoard: text and a scalar marker; W&B: a marker and the numbers;
        CSV: a row with the fields as JSON). Fields must be JSON values. Prints nothing."""
        if not self.enabled:
            return
        self._write({"event": kind, "step": step, **fields, "time": time.time()})
        self._to_trackers("log_event", step, kind, fields)

    def rewind(self, step: int) -> None:
        """After restoring the checkpoint at `step` mid-run (a rollback): trackers that draw curves hide
        the steps after it, which the run now trains again (metrics.jsonl keeps every row)."""
        if self.enabled:
            self._to_trackers("rewind", step)

    def note(self, text: str) -> None:
        if self.enabled:
            # plain text that may quote names (checkpoints, profiled kernels): printed as written
            (self.progress.console if self.progress else self.console).print(f"[dim]{outside(text)}[/]")

    def finish(self, state, saved_checkpoint: bool = True) -> None:
        if not self.enabled:
            return
        self._write({"event": "run_end", "step": state.step, "stopped_by": state.stopped_by, "time": time.time()})
        self.close()
        if state.stopped_by:
            saved = ("checkpoint saved (continue with --resume latest)" if saved_checkpoint
                     else "no checkpoint saved (train.save_checkpoints is false)")
            self.console.print(f"stopped by {state.stopped_by} at step {state.step}; {saved}")

    def close(self) -> None:
        """Stop the progress bar and flush and close the trackers and metrics.jsonl (also when the run
        gives up, so TensorBoard and W&B keep its last records)."""
        if not self.enabled or self.file.closed:
            return
        if self.progress is not None:
            self.progress.stop()
        self._to_trackers("close")
        self.file.close()
