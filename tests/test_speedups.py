"""dstrain/speedups/: the registry's version check on a real engine (tests/scripts/speedups_version.py), and
the config's `speedups:` section reaching the ranks through the frozen config (integration lane: DeepSpeed
start-up, real ranks)."""

from __future__ import annotations

import pytest
import yaml

from launcher import assert_ok, losses, run_tiny
from one_rank import run_script

pytestmark = pytest.mark.integration


def test_a_deepspeed_outside_the_verified_versions_trains_stock_with_one_warning():
    from dstrain.speedups import REGISTRY

    out = run_script("speedups_version", {})
    old, verified = out["old"], out["verified"]
    assert old["applied"] == [] and old["stock"] is True
    assert old["not_applied"] == sorted(entry.name for entry in REGISTRY)
    assert old["defragment"] == "deepspeed.runtime.zero.utils"  # not replaced while the engine was built
    assert len(old["lines"]) == 1 and old["lines"][0].startswith("warning: DeepSpeed 0.18.0 is not a version")
    # the same engine on the installed (verified) DeepSpeed gets dstrain's ZeRO-3 changes
    assert {"zero3_step", "zero3_flatten", "zero3_grads"} <= set(verified["applied"]) and not verified["stock"]
    assert verified["defragment"] == "dstrain.speedups.zero3_flatten"
    assert len(old["norms"]) == len(verified["norms"]) == 3  # both train


def test_the_speedups_section_reaches_the_ranks_through_the_frozen_config(tmp_path):
    """A switch set by its environment variable in `dstrain run`'s shell and one set by --set (which no
    environment carries): the frozen config holds both, and rank 0 leaves both changes out."""
    run_dir = tmp_path / "run"
    result = run_tiny(run_dir, "stage3", "train.max_steps=2", "train.log_every=1", "train.save_checkpoints=false",
                      "speedups.zero3_grads=false", gpus=1, env={"DSTRAIN_ZERO3_HOOKS": "off"})
    assert_ok(result)
    frozen = yaml.safe_load((run_dir / "config.yaml").read_text())["speedups"]
    assert frozen["zero3_hooks"] is False and frozen["zero3_grads"] is False and frozen["zero3_step"] is True
    said = result.stdout.splitlines()
    zero3 = [line for line in said if "ZeRO-3, dstrain's changes:" in line]
    assert len(zero3) == 1 and "batched" in zero3[0], result.stdout[-3000:]
    assert "module hooks" not in zero3[0] and "gradient copies lean" not in zero3[0]
    assert any("zero3_hooks (speedups.zero3_hooks=false)" in line for line in said), result.stdout[-3000:]
    assert any("zero3_grads (speedups.zero3_grads=false)" in line for line in said), result.stdout[-3000:]
    assert sorted(losses(run_dir)) == [1, 2]


def test_the_report_names_what_did_not_apply_only_where_its_family_fits_the_run_or_it_was_switched_off():
    from dstrain.speedups.registry import Report
    stage2 = Report(applied=[], not_applied={"zero3_step": "not ZeRO-3", "offload_syncs": "no ZeRO-1/2 CPU offload"})
    assert stage2.lines() == []
    zero3 = Report(applied=["zero3_step"], not_applied={"zero3_hooks": "no module keeps its parameters gathered",
                                                        "offload_syncs": "no ZeRO-1/2 CPU offload",
                                                        "cuda_stream": "speedups.cuda_stream=false"})
    lines = zero3.lines()
    assert "not applied: zero3_hooks (no module keeps its parameters gathered)" in lines
    assert "not applied: cuda_stream (speedups.cuda_stream=false)" in lines
    assert not any("offload_syncs" in line for line in lines)
    # a run without gradient accumulation hears nothing of the changes made for accumulating runs
    unneeded = {"offload_accumulate_zero3": "no gradient accumulation", "offload_keep_weights": "no gradient accumulation"}
    offload = Report(applied=["offload_chunks_zero3"], not_applied=unneeded)
    assert offload.lines() == ["CPU offload, dstrain's changes: optimizer step in chunks"]
