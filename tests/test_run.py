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
    # (stage2_offload and stage3_offload switch it on here: they are the speed layer's runs too)
    auto_off = "activation checkpointing off: the run without it is estimated at"
    assert first.stdout.count(auto_off) == (1 if preset == "stage3_nvme" else 0)

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


# The offload presets' runs are also the speed layer's bit-identity runs (test_offload_step_in_chunks_...):
# bf16, DeepSpeed's activation checkpointing and accumulation over two micro steps, with dstrain's changes on.
OFFLOAD_SETS = ("train.lr=3e-3", "train.precision=bf16", "train.activation_checkpointing=true",
                "train.grad_accum_steps=2")
# dstrain's offload changes on (forced: auto keeps the sums and kept weights to CUDA), or DeepSpeed's own path
OFFLOAD_CHANGES = {"on": {"DSTRAIN_OFFLOAD_CHUNKS": "4096", "DSTRAIN_OFFLOAD_GRADS": "on",
                          "DSTRAIN_OFFLOAD_ACCUMULATE": "on", "DSTRAIN_OFFLOAD_KEEP_WEIGHTS": "on"},
                   "off": {"DSTRAIN_OFFLOAD_CHUNKS": "off", "DSTRAIN_OFFLOAD_GRADS": "off",
                           "DSTRAIN_OFFLOAD_ACCUMULATE": "off", "DSTRAIN_OFFLOAD_KEEP_WEIGHTS": "off"}}


def _preset_sets(preset: str, run_dir: Path) -> tuple[str, ...]:
    offload = OFFLOAD_SETS if preset in ("stage2_offload", "stage3_offload") else ()
    return (*offload, *_nvme_sets(preset, run_dir))


@pytest.fixture(scope="module")
def preset_runs(tmp_path_factory):
    """preset -> (a copy of the run dir as the first run left it, the first run: steps 1-4 saving 2 and 4, its
    logged (step, loss, gradient norm), the run dir resumed to 6, the resumed run), launched on first use."""
    runs = {}

    def run(preset: str):
        if preset not in runs:
            run_dir = tmp_path_factory.mktemp(preset) / preset
            env = OFFLOAD_CHANGES["on"] if preset in ("stage2_offload", "stage3_offload") else None
            sets = ("train.save_every=2", "train.log_every=1", *_preset_sets(preset, run_dir))
            first = run_tiny(run_dir, preset, "train.max_steps=4", *sets, env=env)
            assert_ok(first)
            saved = run_dir.parent / "saved"
            shutil.copytree(run_dir, saved)
            steps = [(row["step"], row["loss"], row.get("grad_norm")) for row in _rows(run_dir) if "loss" in row]
            resumed = run_tiny(run_dir, preset, "train.max_steps=6", *sets, resume="latest", env=env)
            runs[preset] = SimpleNamespace(saved=saved, first=first, steps=steps, run_dir=run_dir, resumed=resumed)
        return runs[preset]
    return run


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# stage2 is checked on the stage2 runs the resume tests below share (test_stage2_preset_...).
# stage1 is DeepSpeed 0.18.9's smoke run of ZeRO-1, and of saving and resuming, too (.ci/run).
@pytest.mark.parametrize("preset", [pytest.param(p, marks=pytest.mark.oldest_deepspeed) if p == "stage1" else p
                                    for p in PRESETS if p != "stage2"])
def test_preset_trains_checkpoints_and_resumes_on_two_cpu_ranks(preset_runs, preset):
    runs = preset_runs(preset)
    _assert_saved_by_two_ranks(runs.first, runs.saved, preset, step=4)
    _assert_resumed(runs.resumed, runs.run_dir, saved=4, last=6)


# A constant schedule after warmup: a cosine decay would (rightly) change shape with max_steps.
STAGE2_SETS = ("train.save_every=4", "train.log_every=1", "train.lr=3e-3", "train.warmup_steps=2",
               "train.schedule=constant")
# The interrupted runs also use DeepSpeed's activation checkpointing (partitioned, kept on the CPU): the
# straight run without it is their reference, for its losses (steps 1-8) as for the resume's (9-12).
CHECKPOINTING_SETS = ("train.activation_checkpointing=true",
                      "deepspeed.activation_checkpointing.partition_activations=true",
                      "deepspeed.activation_checkpointing.cpu_checkpointing=true")


@pytest.fixture(scope="module")
def stage2_straight(tmp_path_factory):
    """stage2 steps 1-12 in one go, without activation checkpointing: the resume tests' reference, and the
    activation checkpointing test's."""
    run_dir = tmp_path_factory.mktemp("stage2") / "straight"
    return run_dir, run_tiny(run_dir, "stage2", "train.max_steps=12", *STAGE2_SETS)


@pytest.fixture(scope="module")
def stage2_interrupted(tmp_path_factory):
    """stage2 steps 1-8 on 2 ranks (saving 4 and 8) with activation checkpointing, then resumed to 12; `saved`
    is a copy of the run dir as the first run left it (a launch costs ~12 s; each piece is launched only when a
    test asks)."""
    root = tmp_path_factory.mktemp("stage2")
    interrupted, saved = root / "interrupted", root / "saved"
    first = run_tiny(interrupted, "stage2", "train.max_steps=8", *STAGE2_SETS, *CHECKPOINTING_SETS)
    assert_ok(first)
    shutil.copytree(interrupted, saved)
    resumed = run_tiny(interrupted, "stage2", "train.max_steps=12", *STAGE2_SETS, *CHECKPOINTING_SETS,
                       resume="latest")
    return SimpleNamespace(first=first, saved=saved, interrupted=interrupted, resumed=resumed)


@pytest.fixture(scope="module")
def stage2_resumed_by_one(stage2_interrupted):
    """A copy of the saved run (steps 1-8 on 2 ranks), resumed to 12 by 1 rank (accum 2: the same global batch)."""
    one = stage2_interrupted.saved.parent / "one"
    shutil.copytree(stage2_interrupted.saved, one)
    resumed = run_tiny(one, "stage2", "train.max_steps=12", "train.grad_accum_steps=2", *STAGE2_SETS,
                       *CHECKPOINTING_SETS, resume="latest", gpus=1)
    return one, resumed


def test_stage2_preset_trains_checkpoints_and_resumes_on_two_cpu_ranks(stage2_interrupted):
    """test_preset_trains_checkpoints_and_resumes_on_two_cpu_ranks for stage2: saved at 8, resumed to 12."""
    _assert_saved_by_two_ranks(stage2_interrupted.first, stage2_interrupted.saved, "stage2", step=8)
    _assert_resumed(stage2_interrupted.resumed, stage2_interrupted.interrupted, saved=8, last=12)


def test_resumed_run_continues_exactly_like_an_uninterrupted_one(stage2_interrupted, stage2_straight):
    straight, straight_run = stage2_straight
    assert_ok(stage2_interrupted.resumed)
    assert_ok(straight_run)
    a, b = losses(stage2_interrupted.interrupted), losses(straight)
    assert sorted(a) == list(range(1, 13))
    for step in range(9, 13):
        assert a[step] == pytest.approx(b[step], rel=1e-3), (step, a[step], b[step])
    assert b[12] < b[1]  # it learns


def test_resume_with_another_world_size_goes_through_a_universal_checkpoint(stage2_interrupted, stage2_resumed_by_one):
    """Saved by 2 ranks, resumed by 1 (same global batch: accum 2) and by 2: both continue alike."""
    one, resumed = stage2_resumed_by_one
    assert_ok(resumed)
    assert_ok(stage2_interrupted.resumed)
    assert "universal checkpoint" in resumed.stdout
    assert (one / "universal" / "step00000008").is_dir()
    a, b = losses(one), losses(stage2_interrupted.interrupted)
    for step in range(9, 13):
        assert a[step] == pytest.approx(b[step], rel=1e-4), (step, a[step], b[step])


def test_activation_checkpointing_gives_the_same_losses(stage2_interrupted, stage2_straight):
    """DeepSpeed's activation checkpointing (partitioned, kept on the CPU; the interrupted run's steps 1-8)
    against the same stage2 job without it (the straight run). Its own launch until 2026-11-29."""
    straight, straight_run = stage2_straight
    assert_ok(straight_run)
    assert_ok(stage2_interrupted.first)
    a, b = losses(stage2_interrupted.saved), losses(straight)
    assert sorted(a) == list(range(1, 9))
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=1e-5), (step, a[step], b[step])


def test_the_default_job_loss_falls(default_job):
    """The README's main command, shortened: the default model on the embedded corpus learns (conftest's
    default_job, run as examples/default.yaml, which test_examples also checks)."""
    run_dir, result = default_job
    assert_ok(result)
    steps = losses(run_dir)
    assert steps[30] < steps[5] - 0.3, steps
    assert "batch: micro 4 x grad accum 1 x world 2 = 8 sequences" in result.stdout
    # The ranks did not build or load DeepSpeed's shared-memory all-reduce op (training never calls it;
    # dstrain/rank/runtime.py skip_shared_memory_all_reduce_op): DeepSpeed says so in each rank's log when it does.
    for log in sorted((run_dir / "ranks").glob("rank*.log")):
        assert "shm_comm_op built successfully" not in log.read_text(), log


@pytest.mark.parametrize("preset", ["stage2_offload", "stage3_offload"])
def test_offload_step_in_chunks_trains_exactly_as_deepspeeds_step_on_two_ranks(tmp_path, preset_runs, preset):
    """dstrain/speedups/offload_chunked_step.py (ZeRO-1/2, with bf16 gradients on the host), offload_chunked_step_zero3.py,
    offload_grads_zero3.py, offload_accumulate_zero3.py, offload_overlap_zero3.py and offload_keep_weights.py against
    DeepSpeed's own step and gradient copies (DSTRAIN_OFFLOAD_CHUNKS=off, DSTRAIN_OFFLOAD_GRADS=off), two ranks each
    updating its partition in 4,096-element chunks, accumulating over two micro steps on the device
    (offload_accumulate_zero12 and _zero3; ZeRO-3: beside the next forward, the weights kept through each window,
    and saving a checkpoint mid-run and after the last step): the same losses and gradient norms, bit for bit.
    The run with dstrain's changes is the preset test's first run (preset_runs)."""
    runs = preset_runs(preset)
    first, chunked = runs.first, runs.steps
    run_dir = tmp_path / "deepspeed"
    result = run_tiny(run_dir, preset, "train.max_steps=4", "train.save_every=4", "train.log_every=1",
                      *_preset_sets(preset, run_dir), env=OFFLOAD_CHANGES["off"])
    assert_ok(result)
    theirs = [(row["step"], row["loss"], row.get("grad_norm")) for row in _rows(run_dir) if "loss" in row]
    said = {name: [line for line in run.stdout.splitlines() if "CPU offload, dstrain's changes" in line]
            for name, run in (("chunked", first), ("deepspeed", result))}
    assert len(chunked) == 4 and all(norm for _, _, norm in chunked)
    assert chunked == theirs
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
