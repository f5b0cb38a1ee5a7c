"""benchmarks/scaling.py: the scaling table's arithmetic, on rows of the shape suite.py writes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "scaling.py"
spec = importlib.util.spec_from_file_location("scaling", SCRIPT)
scaling = importlib.util.module_from_spec(spec)
spec.loader.exec_module(scaling)


def row(runner, preset, gpus, tps, status="ok"):
    return {"runner": runner, "preset": preset, "gpus": gpus, "variant": "", "tokens_per_s": tps, "status": status}


def test_efficiency_is_against_n_times_the_one_gpu_row_and_the_ratio_against_torch_at_the_same_count():
    rows = [row("torch", "none", 1, 100.0), row("torch", "none", 2, 180.0), row("torch", "none", 4, 340.0),
            row("dstrain", "stage3", 1, 95.0), row("dstrain", "stage3", 2, 190.0),
            row("dstrain", "stage3", 4, None, "out of memory")]
    entries = {(e["runner"], e["preset"]): e["by_gpus"] for e in scaling.scaling_rows(rows)}
    assert entries[("torch", "none")][4]["efficiency"] == 0.85
    assert entries[("dstrain", "stage3")][2] == {"tokens_per_s": 190.0, "status": "ok", "efficiency": 1.0,
                                                 "vs_torch": 1.056}
    assert entries[("dstrain", "stage3")][4]["efficiency"] is None
    table = scaling.render(scaling.scaling_rows(rows))
    assert "190 (1.00, 1.06)" in table and "out of memory" in table
    markdown = scaling.render(scaling.scaling_rows(rows), markdown=True).splitlines()
    assert markdown[0].startswith("| runner | preset | 1 GPU") and markdown[1].startswith("|---|")
