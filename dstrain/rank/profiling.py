"""`profile.steps`: torch.profiler around a few optimizer steps of a run.

Each profiled rank writes a Chrome trace, <run dir>/profile/rank<N>.trace.json.gz (Perfetto or
chrome://tracing open it), and a summary beside it, summary-rank<N>.txt: where the device's time went
(compute, copies each way, how much of the copies ran under compute, idle time), how long the host sat
waiting for the device, and the top operators. Rank 0 prints the device lines. The summary is what tells
an offload run's fetches that overlap compute from ones that stall it.
"""

from __future__ import annotations

import contextlib
import gzip
import json
from dataclasses import dataclass
from pathlib import Path

import torch

# Host calls that block until the device catches up: their time is the host waiting on it.
_HOST_WAITS = {"cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy",
               "hipStreamSynchronize", "hipEventSynchronize", "hipDeviceSynchronize", "hipMemcpy"}


PHASES = ("forward", "backward", "step")  # the train loop's marks, "dstrain/<phase>" in a trace
_profiling = False  # a profiler window is open in this process: the loop marks its phases


def phase(name: str):
    """Marks a phase of the train loop in the trace while a profile runs; nothing otherwise."""
    return torch.profiler.record_function(f"dstrain/{name}") if _profiling else contextlib.nullcontext()


@dataclass
class StepProfiler:
    """Profiles `steps` optimizer steps, after the first `start_after` steps of this run."""

    out_dir: Path
    rank: int
    start_after: int
    steps: int
    record_shapes: bool = False
    with_stack: bool = False
    _profiler: object = None
    _trained: int = 0

    @classmethod
    def build(cls, config, run_dir: Path, rank: int) -> "StepProfiler | None":
        p = config.profile
        if p.steps == 0 or (p.ranks != "all" and rank not in p.ranks):
            return None
        return cls(Path(run_dir) / "profile", rank, p.start_after, p.steps, p.record_shapes, p.with_stack)

    def step_begins(self) -> None:
        if self._profiler is not None or self._trained != self.start_after:  # once: _trained only grows
            return
        from torch.profiler import ProfilerActivity, profile
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._profiler = profile(activities=activities, record_shapes=self.record_shapes, with_stack=self.with_stack)
        _synchronize()  # the window starts with nothing of earlier steps still running
        self._profiler.start()
        _set_profiling(True)

    def step_ended(self) -> list[str]:
        """Call after each optimizer step; returns the summary's device lines when profiling ends here."""
        self._trained += 1
        if self._profiler is None or self._trained < self.start_after + self.steps:
            return []
        return self.finish()

    def finish(self) -> list[str]:
        """Stop (also when the run ends before the last profiled step), write the trace and the summary."""
        if self._profiler is None:
            return []
        _synchronize()
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        _set_profiling(False)
        steps = self._trained - self.start_after
        self.out_dir.mkdir(parents=True, exist_ok=True)
        trace = self.out_dir / f"rank{self.rank}.trace.json.gz"
        partial = trace.with_name(trace.name + ".partial.gz")  # torch compresses by the suffix
        profiler.export_chrome_trace(str(partial))
        partial.replace(trace)
        with gzip.open(trace, "rt") as f:
            timeline = summarize_trace(json.load(f), steps)
        table = profiler.key_averages().table(
            sort_by="self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total", row_limit=25,
            max_name_column_width=70)
        header = [f"profiled {steps} optimizer step(s) after {self.start_after} on rank {self.rank}; trace: {trace}"]
        (self.out_dir / f"summary-rank{self.rank}.txt").write_text("\n".join(header + timeline + ["", table]) + "\n")
        return header + timeline


def summarize_trace(trace: dict, steps: int) -> list[str]:
    """The device's timeline in a Chrome trace, per optimizer step: compute (kernels), copies to and from the
    device and the part of them that ran while a kernel ran, time with nothing on the device, and the host's
    time in calls that wait for the device."""
    kernels, to_device, from_device, host_waits = [], [], [], 0.0
    moved = {"HtoD": 0, "DtoH": 0}
    # Host time in the loop's marks. Not the device's: the backward's kernels are launched by autograd's
    # own thread, outside the mark, so a device-side span per mark would misattribute them.
    phases = dict.fromkeys(PHASES, 0.0)
    for event in trace.get("traceEvents", []):
        if event.get("ph") != "X" or "dur" not in event:
            continue
        span = (float(event["ts"]), float(event["ts"]) + float(event["dur"]))
        category, name = event.get("cat", ""), event.get("name", "")
        if category == "kernel":
            kernels.append(span)
        elif category == "gpu_memcpy" and ("HtoD" in name or "DtoH" in name):
            direction = "HtoD" if "HtoD" in name else "DtoH"
            (to_device if direction == "HtoD" else from_device).append(span)
            moved[direction] += int(event.get("args", {}).get("bytes", 0))
        elif category in ("cuda_runtime", "cuda_driver") and name in _HOST_WAITS:
            host_waits += span[1] - span[0]
        elif category == "user_annotation" and name.startswith("dstrain/") and name[len("dstrain/"):] in phases:
            phases[name[len("dstrain/"):]] += span[1] - span[0]
    marked = ("host time a step in the loop's forward / backward / step: "
              + " / ".join(f"{phases[name] / 1000 / steps:,.1f}" for name in PHASES) + " ms")
    if not (kernels or to_device or from_device):
        return ["no device activity recorded (a CPU run): the operator table below is the host's", marked]
    compute, up, down = _union(kernels), _union(to_device), _union(from_device)
    everything = _union(kernels + to_device + from_device)
    window = everything[-1][1] - everything[0][0]
    per = 1000.0 * steps  # microseconds to milliseconds a step

    def ms(total_us: float) -> str:
        return f"{total_us / per:,.1f} ms"

    def share(part: float, whole: float) -> str:
        return f"{100 * part / whole:.0f}%" if whole else "-"

    def volume(direction: str, busy_us: float) -> str:
        total = moved[direction]
        return f"{total / steps / 1e9:,.2f} GB ({total / busy_us / 1e3:,.1f} GB/s)" if busy_us else "0 GB"

    busy, up_total, down_total = _length(compute), _length(up), _length(down)
    up_under, down_under = _length(_intersect(up, compute)), _length(_intersect(down, compute))
    return [f"device time a step: {ms(window)} from its first to its last operation",
            f"  compute (kernels): {ms(busy)} ({share(busy, window)} of it)",
            f"  copies to the device: {ms(up_total)}, {volume('HtoD', up_total)}, "
            f"{share(up_under, up_total)} of it under compute",
            f"  copies to the host: {ms(down_total)}, {volume('DtoH', down_total)}, "
            f"{share(down_under, down_total)} of it under compute",
            f"  nothing running on the device: {ms(window - _length(everything))}",
            f"host waiting on the device (synchronize calls): {ms(host_waits)}", marked]


def _set_profiling(on: bool) -> None:
    global _profiling
    _profiling = on


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Overlap of two sorted, disjoint span lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in spans)
