"""`dstrain estimate` end to end (the issue's acceptance figures) and `dstrain run --preset auto`."""

from __future__ import annotations

import json

import pytest

from launcher import dstrain

P, N = 7e9, 8
ZERO_PAPER = {"stage1": 4 * P + 12 * P / N, "stage2": 2 * P + 14 * P / N, "stage3": 16 * P / N}


def _estimate_json(*args: str) -> dict:
    result = dstrain("estimate", *args, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.slow
def test_estimate_7b_on_8_gpus_lists_six_presets_within_the_zero_paper_band():
    report = _estimate_json("--params", "7e9", "--gpus", "8", "--nodes", "1", "--gpu-mem", "80")
    presets = {p["name"]: p for p in report["presets"]}
    assert list(presets) == ["stage1", "stage2", "stage3", "stage2_offload", "stage3_offload", "stage3_nvme"]
    # stage3 keeps the blocks' 16-bit weights whole where they fit (launcher/preflight.keep_large_gpt_blocks_whole):
    # the paper's layout plus those weights less their shard
    stage3 = presets["stage3"]
    whole = stage3["gpu_breakdown"]["model_states"].get("params_persistent", 0)
    assert stage3["placement"]["stage3_param_persistence_threshold"] > 100_000 and whole > 0.5 * 2 * P * (1 - 1 / N)
    for name, paper in ZERO_PAPER.items():
        ratio = (presets[name]["gpu_bytes_per_gpu"] - (whole if name == "stage3" else 0)) / paper
        assert 0.8 <= ratio <= 1.6, (name, ratio)
    assert presets["stage3_offload"]["gpu_bytes_per_gpu"] < presets["stage3"]["gpu_bytes_per_gpu"] / 4
    assert presets["stage3_offload"]["cpu_bytes_per_node"] >= 16 * P
    assert presets["stage3_nvme"]["nvme_bytes"] > 0
    assert report["recommended"] in presets


@pytest.mark.slow
def test_estimate_recommends_the_fastest_preset_that_fits():
    roomy = _estimate_json("--params", "1e8", "--gpus", "1", "--gpu-mem", "80", "--cpu-mem", "512")
    assert roomy["recommended"] == "stage1"
    tight = _estimate_json("--params", "13e9", "--gpus", "1", "--gpu-mem", "24", "--cpu-mem", "512")
    assert tight["recommended"] in ("stage3_offload", "stage3_nvme")
    assert "fastest" in tight["reason"]


@pytest.mark.slow
def test_estimate_prefers_stage3_to_cpu_offload_where_stage_1_and_2_do_not_fit():
    """Measured on one GPU, stage 3 runs 2-3x stage2_offload's speed (docs/benchmarks.md): a 4B model on one
    80 GiB GPU fits stage 3 and stage2_offload but not stage 1/2, and stage 3 is the recommendation."""
    report = _estimate_json("--params", "4e9", "--gpus", "1", "--gpu-mem", "80", "--cpu-mem", "512")
    fits = {p["name"]: p["fits"] for p in report["presets"]}
    assert fits == {"stage1": False, "stage2": False, "stage3": True, "stage2_offload": True,
                    "stage3_offload": True, "stage3_nvme": True}
    assert report["recommended"] == "stage3"
    assert "faster presets do not: stage1" in report["reason"] and "stage2_offload" not in report["reason"]


@pytest.mark.slow
def test_run_preset_auto_picks_a_preset_and_says_why():
    result = dstrain("run", "--preset", "auto", "--accelerator", "cpu", "--gpus", "1", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "--preset auto: stage1" in result.stdout
    assert "fastest preset that fits" in result.stdout
