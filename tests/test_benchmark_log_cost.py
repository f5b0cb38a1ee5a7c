"""benchmarks/suite.py --log-cost: both rows are timed over the same second half of the run, and the
cost line compares them (the GPU figure itself is the lead's to measure: docs/benchmarks.md)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SUITE = Path(__file__).resolve().parents[1] / "benchmarks" / "suite.py"


@pytest.fixture(scope="module")
def suite():
    spec = importlib.util.spec_from_file_location("bench_suite", SUITE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _metrics(run_dir: Path, logged_steps, seconds_per_step: float) -> Path:
    run_dir.mkdir()
    rows = [{"event": "run_start", "step": 0, "time": 0.0}]
    rows += [{"step": s, "loss": 1.0, "tokens_per_s": 1.0, "time": 100.0 + s * seconds_per_step} for s in logged_steps]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def test_second_half_rate_uses_the_middle_and_last_steps_whatever_the_log_interval(suite, tmp_path):
    every = _metrics(tmp_path / "every", range(1, 11), seconds_per_step=0.5)
    half = _metrics(tmp_path / "half", [5, 10], seconds_per_step=0.5)
    assert suite._second_half_rate(every, 10, 1000) == pytest.approx(5 * 1000 / 2.5)
    assert suite._second_half_rate(half, 10, 1000) == pytest.approx(5 * 1000 / 2.5)
    assert suite._second_half_rate(_metrics(tmp_path / "short", [10], 0.5), 10, 1000) is None


def test_log_cost_line_compares_log_all_with_log_none_of_the_same_preset_and_gpus(suite):
    rows = [{"runner": "dstrain", "variant": "log_none", "preset": "stage2", "gpus": 1, "steps": 120,
             "second_half_tokens_per_s": 100_000.0},
            {"runner": "dstrain", "variant": "log_all", "preset": "stage2", "gpus": 1, "steps": 120,
             "second_half_tokens_per_s": 98_500.0},
            {"runner": "dstrain", "variant": "log_all", "preset": "stage3", "gpus": 1, "steps": 120,
             "second_half_tokens_per_s": 50_000.0}]  # no partner: no line
    assert suite.log_cost_lines(rows) == [
        "log cost stage2 1 GPU: 100,000 -> 98,500 tokens/s over steps 60-120: "
        "logging every step to metrics.jsonl, TensorBoard and CSV costs +1.50%"]
