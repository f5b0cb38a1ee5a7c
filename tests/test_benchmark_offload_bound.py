"""benchmarks/offload_bound.py: the step-time bound of the offload rows from the host's Adam bandwidth, the
PCIe rates and torch's step time, as its docstring states it (the rates themselves are measured on the GPU
machine; tests/test_benchmarks.py runs the measurement on CPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "offload_bound.py"
RATES = {"adam_gb_s": 26.0, "h2d_gb_s": 50.0, "d2h_gb_s": 40.0}
P = 10**9  # parameters


@pytest.fixture(scope="module")
def ob():
    spec = importlib.util.spec_from_file_location("offload_bound", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stage2_offload_waits_for_the_backward_then_runs_adam_before_the_next_forward(ob):
    parts = ob.bound("stage2_offload", P, 1, RATES, torch_step_s=0.5)
    assert parts["adam_s"] == pytest.approx(1.0)           # 26 bytes a parameter at 26 GB/s
    assert parts["down_s"] == pytest.approx(2 / 40)        # bf16 gradients
    assert parts["up_s"] == pytest.approx(4 / 50)          # fp32 chunks to the GPU
    assert parts["bound_s"] == pytest.approx(0.5 + 1.0)    # max(GPU, down) + max(Adam, up)


def test_stage3_offload_hides_only_the_next_forward_behind_its_step(ob):
    parts = ob.bound("stage3_offload", P, 1, RATES, torch_step_s=0.6)
    assert parts["adam_s"] == pytest.approx(28 / 26)       # + the bf16 weights rounded in the same pass
    assert parts["up_s"] == pytest.approx(4 / 50)          # bf16 weights fetched in forward and backward
    # the step waits for the whole backward; the next forward (a third of the step) runs beside it
    assert parts["bound_s"] == pytest.approx(0.6 + 28 / 26 - 0.2)


def test_accumulation_spreads_the_adam_step_over_more_gpu_work(ob):
    parts = ob.bound("stage2_offload", P, 8, RATES, torch_step_s=0.5)
    assert parts["gpu_s"] == pytest.approx(4.0) and parts["down_s"] == pytest.approx(4 / 40)  # fp32 sums, once
    assert parts["bound_s"] == pytest.approx(4.0 + 1.0)
    parts = ob.bound("stage3_offload", P, 8, RATES, torch_step_s=0.6)
    assert parts["up_s"] == pytest.approx(2 / 50)          # the weights fetched once a window, kept through it
    assert parts["bound_s"] == pytest.approx(8 * 0.6 + 28 / 26 - 0.2)
    # torch measured at the same accumulation: its window is the GPU's part (its optimizer step once)
    same = ob.bound("stage3_offload", P, 8, RATES, torch_step_s=4.5, torch_accumulation=8)
    assert same["gpu_s"] == pytest.approx(4.5) and same["bound_s"] == pytest.approx(4.5 + 28 / 26 - 4.5 / 8 / 3)
    # a step shorter than the first forward hides behind it entirely
    assert ob.bound("stage3_offload", P, 8, RATES, torch_step_s=6.0)["bound_s"] == pytest.approx(48.0)


def test_without_a_gpu_or_torch_row_only_the_host_bounds(ob):
    parts = ob.bound("stage3_offload", P, 1, {"adam_gb_s": 28.0, "h2d_gb_s": None, "d2h_gb_s": None}, None)
    assert (parts["gpu_s"], parts["down_s"], parts["up_s"]) == (0.0, 0.0, 0.0)
    assert parts["bound_s"] == pytest.approx(1.0)
