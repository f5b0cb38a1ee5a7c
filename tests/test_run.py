"""`dstrain run` end to end: real ranks through the deepspeed launcher on CPU, every preset,
checkpoints on disk, exact resume."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from launcher import assert_ok, losses, run_tiny

pytestmark = pytest.mark.integration

PRESETS = ["stage1", "stage2", "stage2_offload", "stage3", "stage3_offload", "stage3_nvme"]


def _nvme_sets(preset: str, run_dir) -> tuple[str, ...]:
    if preset != "stage3_nvme":
        return ()
    path = run_dir.parent / f"{run_dir.name}-nvme"
    return (f"deepspeed.zero_optimization.offload_param.nvme_path={path}",
            f"deepspeed.zero_optimization.offload_optimizer.nvme_path={path}")


def _assert_saved_by_two_ranks(first, run_dir: Path, preset: str, step: int) -> None:
    """What a preset's first run prints and leaves: a complete checkpoint of both ranks at `step`, the latest."""
    assert_ok(first)
    # ZeRO-3 without offload trains with dstrain's step (speedups/zero3_step.py), and rank 0 says so once
    assert first.stdout.count("ZeRO-3, dstrain's changes: the step's release") == (1 if preset == "stage3" else 0)
    # the offload presets' activation checkpointing is "auto": off for the tiny model in host RAM, said once
    auto_off = "activation checkpointing off: the run without it is estimated at"
    assert first.stdout.count(auto_off) == (1 if preset in ("stage3_offload", "stage3_nvme") else 0)

    tag = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert tag == f"step{step:08d}"
    files = {p.name for p in (run_dir / "checkpoints" / tag).iterdir()}
    assert {"rng_rank0.pt", "rng_rank1.pt", "dstrain_complete.json"} <= files
    assert sum("optim_states" in name for name in files) == 2, files  # one optimizer shard per rank
    mark = json.loads((run_dir / "checkpoints" / tag / "dstrain_complete.json").read_text())
    assert mark["world_size"] == 2 and mark["step"] == step
    config = (run_dir / "ds_config.json").read_text()
    assert '"auto"' not in config


def _assert_resumed(resumed, run_dir: Path, saved: int, last: int) -> None:
    assert_ok(resumed)
    assert f"resumed from step{saved:08d} at step {saved}" in resumed.stdout
    steps = losses(run_dir)
    assert sorted(steps) == list(range(1, last + 1))
    assert all(math.isfinite(v) for v in steps.values())
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step{last:08d}"


# stage2 is checked on the stage2 runs the resume tests below share (test_stage2_preset_...).
@pytest.mark.parametrize("preset", [p for p in PRESETS if p != "stage2"])
def test_preset_trains_checkpoints_and_resumes_on_two_cpu_ranks(tmp_path, preset):
    run_dir = tmp_path / preset
    sets = ("train.max_steps=4", "train.save_every=2", "train.log_every=1", *_nvme_sets(preset, run_dir))
    first = run_tiny(run_dir, preset, *sets)
    _assert_saved_by_two_ranks(first, run_dir, preset, step=4)

    resumed = run_tiny(run_dir, preset, "train.max_steps=6", "train.save_every=2", "train.log_every=1",
                       *_nvme_sets(preset, run_dir), resume="latest")
    _assert_resumed(resumed, run_dir, saved=4, last=6)


# A constant schedule after warmup: a cosine decay would (rightly) change shape with max_steps.
STAGE2_SETS = ("train.save_every=4", "train.log_every=1", "train.lr=3e-3", "train.warmup_steps=2",
               "train.schedule=constant")


@pytest.fixture(scope="module")
def stage2_straight(tmp_path_factory):
    """stage2 steps 1-12 in one go: the resume tests' reference, and the activation checkpointing test's."""
    run_dir = tmp_path_factory.mktemp("stage2") / "straight"
    return run_dir, run_tiny(run_dir, "stage2", "train.max_steps=12", *STAGE2_SETS)


@pytest.fixture(scope="module")
def stage2_runs(tmp_path_factory, stage2_straight):
    """The stage2 runs of the next three tests, launched once for all three (a launch costs ~12 s, and CI's
    oldest-DeepSpeed lane runs these tests again): `interrupted` trains steps 1-8 on 2 ranks (saving 4 and
    8) and resumes to 12; `saved` is a copy of it as its first run left it; `one` is another copy, resumed
    to 12 by 1 rank (accum 2: the same global batch); `straight` trains 1-12 in one go."""
    root = tmp_path_factory.mktemp("stage2")
    interrupted, saved, one = (root / name for name in ("interrupted", "saved", "one"))
    first = run_tiny(interrupted, "stage2", "train.max_steps=8", *STAGE2_SETS)
    assert_ok(first)
    shutil.copytree(interrupted, saved)
    shutil.copytree(interrupted, one)
    resumed = run_tiny(interrupted, "stage2", "train.max_steps=12", *STAGE2_SETS, resume="latest")
    resumed_by_one = run_tiny(one, "stage2", "train.max_steps=12", "train.grad_accum_steps=2", *STAGE2_SETS,
                              resume="latest", gpus=1)
    straight, straight_run = stage2_straight
    return SimpleNamespace(first=first, saved=saved, interrupted=interrupted, resumed=resumed, one=one,
                           resumed_by_one=resumed_by_one, straight=straight, straight_run=straight_run)


@pytest.mark.oldest_deepspeed
def test_stage2_preset_trains_checkpoints_and_resumes_on_two_cpu_ranks(stage2_runs):
    """test_preset_trains_checkpoints_and_resumes_on_two_cpu_ranks for stage2: saved at 8, resumed to 12."""
    _assert_saved_by_two_ranks(stage2_runs.first, stage2_runs.saved, "stage2", step=8)
    _assert_resumed(stage2_runs.resumed, stage2_runs.interrupted, saved=8, last=12)


@pytest.mark.oldest_deepspeed
def test_resumed_run_continues_exactly_like_an_uninterrupted_one(stage2_runs):
    assert_ok(stage2_runs.resumed)
    assert_ok(stage2_runs.straight_run)
    a, b = losses(stage2_runs.interrupted), losses(stage2_runs.straight)
    assert sorted(a) == list(range(1, 13))
    for step in range(9, 13):
        assert a[step] == pytest.approx(b[step], rel=1e-3), (step, a[step], b[step])
    assert b[12] < b[1]  # it learns


@pytest.mark.oldest_deepspeed
def test_resume_with_another_world_size_goes_through_a_universal_checkpoint(stage2_runs):
    """Saved by 2 ranks, resumed by 1 (same global batch: accum 2) and by 2: both continue alike."""
    resumed = stage2_runs.resumed_by_one
    assert_ok(resumed)
    assert_ok(stage2_runs.resumed)
    assert "universal checkpoint" in resumed.stdout
    assert (stage2_runs.one / "universal" / "step00000008").is_dir()
    a, b = losses(stage2_runs.one), losses(stage2_runs.interrupted)
    for step in range(9, 13):
        assert a[step] == pytest.approx(b[step], rel=1e-4), (step, a[step], b[step])


def test_activation_checkpointing_gives_the_same_losses(tmp_path, stage2_straight):
    """DeepSpeed's activation checkpointing (partitioned, kept on the CPU) against the same stage2 job
    without it: the resume tests' straight run."""
    plain, plain_run = stage2_straight
    assert_ok(plain_run)
    ckpt = tmp_path / "ckpt"
    assert_ok(run_tiny(ckpt, "stage2", "train.max_steps=12", *STAGE2_SETS, "train.activation_checkpointing=true",
                       "deepspeed.activation_checkpointing.partition_activations=true",
                       "deepspeed.activation_checkpointing.cpu_checkpointing=true"))
    a, b = losses(plain), losses(ckpt)
    assert sorted(a) == sorted(b) == list(range(1, 13))
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=1e-5)


def test_the_default_job_loss_falls(default_job):
    """The README's main command, shortened: the default model on the embedded corpus learns (conftest's
    default_job, run as examples/default.yaml, which test_examples also checks)."""
    run_dir, result = default_job
    assert_ok(result)
    steps = losses(run_dir)
    assert steps[30] < steps[5] - 0.3, steps
    assert "batch: micro 4 x grad accum 1 x world 2 = 8 sequences" in result.stdout


def test_save_checkpoints_false_trains_and_evaluates_but_writes_no_checkpoint(tmp_path):
    run_dir = tmp_path / "throwaway"
    result = run_tiny(run_dir, "stage2", "train.max_steps=3", "train.save_every=1", "train.log_every=1",
                      "train.save_checkpoints=false", gpus=1)
    assert_ok(result)
    assert sorted(losses(run_dir)) == [1, 2, 3]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("eval_loss" in r for r in records)  # the final evaluation still runs
    checkpoints = run_dir / "checkpoints"
    assert not checkpoints.exists() or not any(checkpoints.iterdir())


@pytest.mark.parametrize("preset", ["stage2_offload", "stage3_offload"])
def test_offload_step_in_chunks_trains_exactly_as_deepspeeds_step_on_two_ranks(tmp_path, preset):
    """dstrain/speedups/offload_chunked_step.py (ZeRO-1/2, with bf16 gradients on the host), offload_chunked_step_zero3.py,
    offload_grads_zero3.py, offload_accumulate_zero3.py, offload_overlap_zero3.py and offload_keep_weights.py against
    DeepSpeed's own step and gradient copies (DSTRAIN_OFFLOAD_CHUNKS=off, DSTRAIN_OFFLOAD_GRADS=off), two ranks each
    updating its partition in 4,096-element chunks, accumulating over two micro steps on the device
    (offload_accumulate_zero12 and _zero3; ZeRO-3: beside the next forward, the weights kept through each window,
    and saving a checkpoint after the last step): the same losses and gradient
    norms, bit for bit."""
    sets = ("train.max_steps=5", "train.log_every=1", "train.save_every=5", "train.lr=3e-3")
    sets += ("train.precision=bf16",)  # bf16 weights: the gradients go to the host in bf16
    sets += ("train.activation_checkpointing=true",)  # DeepSpeed's checkpointing under offload, too
    sets += ("train.grad_accum_steps=2",)  # the sums on the device, forced on (auto keeps them to CUDA)
    runs = {}
    said = {}
    for name, chunks, grads in (("chunked", "4096", "on"), ("deepspeed", "off", "off")):
        run_dir = tmp_path / name
        env = {"DSTRAIN_OFFLOAD_CHUNKS": chunks, "DSTRAIN_OFFLOAD_GRADS": grads, "DSTRAIN_OFFLOAD_ACCUMULATE": grads,
               "DSTRAIN_OFFLOAD_KEEP_WEIGHTS": grads}
        result = run_tiny(run_dir, preset, *sets, env=env)
        assert_ok(result)
        said[name] = [line for line in result.stdout.splitlines() if "CPU offload, dstrain's changes" in line]
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        runs[name] = [(row["step"], row["loss"], row.get("grad_norm")) for row in rows if "loss" in row]
    assert len(runs["chunked"]) == 5 and all(norm for _, _, norm in runs["chunked"])
    assert runs["chunked"] == runs["deepspeed"]
    # rank 0 says what it changed, once; the switches take the step and the ZeRO-3 copies back to DeepSpeed
    assert len(said["chunked"]) == 1 and "optimizer step in chunks" in said["chunked"][0]
    assert ("gradients sent to the host once, in bf16" in said["chunked"][0]) is (preset == "stage3_offload")
    assert ("gradients sent to the host in bf16" in said["chunked"][0]) is (preset == "stage2_offload")
    assert ("the step beside the next forward" in said["chunked"][0]) is (preset == "stage3_offload")
    assert ("bf16 weights rounded in the Adam pass" in said["chunked"][0]) is (preset == "stage3_offload")
    assert "gradients accumulated on the GPU" in said["chunked"][0]
    # ZeRO-3: the weights stay gathered through each window (forced on: auto keeps them to CUDA)
    assert ("weights kept on the GPU between micro steps" in said["chunked"][0]) is (preset == "stage3_offload")
    if preset == "stage2_offload":  # the per-parameter waits have no switch
        assert said["deepspeed"] and "chunks" not in said["deepspeed"][0]
    else:
        assert said["deepspeed"] == []
