"""dstrain/rank/profiling.py: the profile's device summary read from a Chrome trace (torch.profiler's
format, with known spans), and a real torch.profiler window around steps of a model on this CPU."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from dstrain.config.schema import RunConfig
from dstrain.rank.profiling import StepProfiler, summarize_trace


def _event(cat: str, name: str, ts: float, dur: float, **args) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}


def test_the_summary_splits_device_time_into_compute_copies_overlap_and_idle():
    # Two steps over one second: kernels 0-400 and 600-900 ms; a copy to the device 300-500 ms (half of it
    # under a kernel), one to the host 900-1000 ms (none under one); 500-600 ms with nothing on the device;
    # 250 ms of host waits. Per step: half of each.
    ms = 1000  # the trace's unit is the microsecond
    trace = {"traceEvents": [
        _event("kernel", "gemm", 0, 400 * ms), _event("kernel", "gemm", 600 * ms, 300 * ms),
        _event("kernel", "add", 100 * ms, 50 * ms),  # inside the first: counted once
        _event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 300 * ms, 200 * ms, bytes=8_000_000_000),
        _event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 900 * ms, 100 * ms, bytes=2_000_000_000),
        _event("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 0, 10 * ms),  # neither direction
        _event("cuda_runtime", "cudaStreamSynchronize", 0, 200 * ms),
        _event("cuda_runtime", "cudaEventSynchronize", 0, 50 * ms),
        _event("cuda_runtime", "cudaMemcpyAsync", 0, 999 * ms),  # launches a copy: not a wait
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 5000 * ms},  # no duration: skipped
        _event("user_annotation", "dstrain/forward", 0, 100 * ms), _event("user_annotation", "dstrain/backward",
                                                                          100 * ms, 600 * ms),
        _event("user_annotation", "dstrain/step", 700 * ms, 20 * ms), _event("user_annotation", "other", 0, 5 * ms),
        _event("gpu_user_annotation", "dstrain/forward", 0, 300 * ms),  # the device's side: not counted
    ]}
    assert summarize_trace(trace, steps=2) == [
        "device time a step: 500.0 ms from its first to its last operation",
        "  compute (kernels): 350.0 ms (70% of it)",
        "  copies to the device: 100.0 ms, 4.00 GB (40.0 GB/s), 50% of it under compute",
        "  copies to the host: 50.0 ms, 1.00 GB (20.0 GB/s), 0% of it under compute",
        "  nothing running on the device: 50.0 ms",
        "host waiting on the device (synchronize calls): 125.0 ms",
        "host time a step in the loop's forward / backward / step: 50.0 / 300.0 / 10.0 ms"]


def test_a_trace_without_device_events_says_so():
    trace = {"traceEvents": [_event("cpu_op", "aten::mm", 0, 10)]}
    assert summarize_trace(trace, steps=1) == [
        "no device activity recorded (a CPU run): the operator table below is the host's",
        "host time a step in the loop's forward / backward / step: 0.0 / 0.0 / 0.0 ms"]


def test_the_profiler_covers_the_steps_after_start_after_and_writes_trace_and_summary(tmp_path):
    config = RunConfig.model_validate({"profile": {"steps": 2, "start_after": 1}})
    profiler = StepProfiler.build(config, tmp_path, rank=0)
    assert StepProfiler.build(config, tmp_path, rank=1) is None  # ranks: [0] by default
    model, x = torch.nn.Linear(32, 32), torch.randn(4, 32)
    said = []
    for step in range(5):
        profiler.step_begins()
        model(x * (step + 1)).sum().backward()
        said.append(profiler.step_ended())
    assert [bool(lines) for lines in said] == [False, False, True, False, False]  # ends after step 3
    assert said[2][0] == f"profiled 2 optimizer step(s) after 1 on rank 0; trace: {tmp_path}/profile/rank0.trace.json.gz"
    with gzip.open(tmp_path / "profile" / "rank0.trace.json.gz", "rt") as f:
        events = json.load(f)["traceEvents"]
    # Three steps' backward ran, two inside the window: the profiled matrix products are those two steps'.
    forwards = [e for e in events if e.get("name") == "aten::addmm"]
    assert len(forwards) == 2
    summary = (tmp_path / "profile" / "summary-rank0.txt").read_text()
    assert "aten::addmm" in summary and "no device activity recorded" in summary
    assert profiler.finish() == []  # already written


def test_a_run_that_ends_inside_the_window_still_writes_its_profile(tmp_path):
    config = RunConfig.model_validate({"profile": {"steps": 5, "start_after": 0, "ranks": "all"}})
    profiler = StepProfiler.build(config, tmp_path, rank=3)
    profiler.step_begins()
    torch.ones(8).cumsum(0)
    assert profiler.step_ended() == []
    lines = profiler.finish()
    assert lines[0].startswith("profiled 1 optimizer step(s) after 0 on rank 3")
    assert (tmp_path / "profile" / "rank3.trace.json.gz").is_file()


@pytest.mark.parametrize("bad", [{"steps": -1}, {"ranks": [-1]}, {"ranks": "some"}, {"every": 2}])
def test_bad_profile_keys_are_refused(bad):
    with pytest.raises(ValueError):
        RunConfig.model_validate({"profile": bad})
