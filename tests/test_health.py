"""Run health (issue 17): the guard that spots a non-finite or spiking step, rolls back to the last
complete checkpoint and skips that step's samples; `--resume auto`; time-based saves; early stopping.

Unit tests check the pieces (detector, skip-list arithmetic, rollback target, auto-resume choice,
config checks). The `integration` tests read two launches of one run directory through `dstrain run` and
the deepspeed launcher (2 CPU ranks each): `gave_up` starts fresh with `--resume auto`, saves by the clock,
rolls back once and gives up at the second bad step; `continued` resumes it with `--resume auto` and more
rollbacks allowed, keeps the skips and the rollback count, rolls back again and stops early.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from dstrain.checkpoints import COMPLETE_MARK, LATEST, find_resume_auto, tag_for
from dstrain.cli import app
from dstrain.data.sampler import DatasetSampler
from dstrain.rank.cadence import EarlyStop, SaveClock
from dstrain.rank.health import Detector, HealthState, data_step, rollback_target, samples_of
from dstrain.launcher.supervise import every_rank_gave_up
from dstrain.rundir import CHECKPOINTS, GAVE_UP, HEALTH, RANKS
from launcher import assert_ok, dstrain

USER_CODE = Path(__file__).parent / "user_code"


# ------------------------------------------------------------------ detector

def test_a_non_finite_loss_is_a_bad_step():
    assert Detector(None, 4).judge(10, [2.0, math.inf, 2.0], [1.0, 1.0, 1.0]).step == 11
    assert "non-finite loss (nan)" in Detector(None, 4).judge(10, [math.nan], [1.0]).reason


def test_a_non_finite_gradient_norm_is_a_bad_step_including_deepspeeds_minus_one():
    assert Detector(None, 4).judge(1, [2.0, 2.0], [1.0, math.inf]).step == 2
    # DeepSpeed reports an inf/NaN bf16 norm as -1 when its own overflow check is off
    verdict = Detector(None, 4).judge(1, [2.0], [-1.0])
    assert verdict.step == 1 and verdict.reason == "non-finite gradient norm"


def test_an_unknown_gradient_norm_is_not_judged():
    assert Detector(None, 4).judge(1, [2.0, 2.0], [None, None]) is None


def test_the_first_bad_step_is_named_not_the_ones_it_spoiled():
    assert Detector(None, 4).judge(5, [1.0, math.inf, math.nan, math.nan], [1.0] * 4).step == 6


def test_a_spike_over_the_factor_times_the_window_median_is_a_bad_step():
    detector = Detector(spike_factor=3.0, window=4)
    assert detector.judge(1, [2.0, 2.2, 1.8, 2.0], [1.0] * 4) is None
    verdict = detector.judge(5, [5.9, 6.5], [1.0, 1.0])  # 5.9 < 3 x 2.0; then the median is 2.1: 6.5 > 6.3
    assert verdict.step == 6
    assert verdict.reason == "loss spike (6.5 > 3 x the median 2.1 of the last 4 steps)"


def test_no_spike_is_judged_before_the_window_is_full_or_when_off():
    assert Detector(spike_factor=2.0, window=4).judge(1, [10.0, 1.0, 1.0, 50.0], [None] * 4) is None
    assert Detector(spike_factor=None, window=2).judge(1, [1.0, 1.0, 1000.0], [None] * 3) is None


def test_the_spike_window_slides_over_the_recent_healthy_steps():
    detector = Detector(spike_factor=2.0, window=3)
    assert detector.judge(1, [10.0, 10.0, 10.0, 4.0, 4.0, 4.0], [None] * 6) is None  # a falling loss
    assert detector.judge(7, [9.0], [None]).step == 7  # median now 4, not 10


# ------------------------------------------------------------------ skip-list arithmetic

def test_without_skips_a_step_trains_on_its_own_data_step():
    assert [data_step(s, []) for s in range(5)] == [0, 1, 2, 3, 4]


def test_skipped_data_steps_are_never_used_and_no_data_step_is_used_twice():
    skipped = [4, 5, 9]
    used = [data_step(s, skipped) for s in range(12)]
    assert used == [0, 1, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14]
    assert data_step(3, skipped) == 3  # steps before the first skip are unchanged: a rollback replays them


def test_the_skip_list_order_does_not_matter():
    assert [data_step(s, [9, 4, 5]) for s in range(8)] == [data_step(s, [4, 5, 9]) for s in range(8)]


def test_a_data_step_covers_one_global_batch_of_samples():
    assert samples_of(4, 8) == range(32, 40)


def test_a_resume_skips_what_the_checkpoint_and_health_json_recorded(tmp_path):
    (tmp_path / HEALTH).write_text(json.dumps({"skipped_data_steps": [4, 9], "rollbacks": [{"n": 1}, {"n": 2}]}))
    state = HealthState.on_resume({"skipped_data_steps": [4], "rollbacks": [{"n": 1}]}, tmp_path)
    assert state.skipped == [4, 9] and len(state.rollbacks) == 2
    assert HealthState.on_resume({"skipped_data_steps": [2], "rollbacks": []}, tmp_path / "none").skipped == [2]


# ------------------------------------------------------------------ rollback target and auto-resume

def test_a_job_whose_ranks_all_gave_up_is_a_give_up_even_if_one_died_in_teardown(tmp_path):
    # The launcher reports a rank that aborted after its report (exit -6) as a crash; dstrain run's
    # exit code follows the ranks' records instead.
    ranks = tmp_path / RANKS
    ranks.mkdir()
    for rank in (0, 1):
        (ranks / f"rank{rank}.pid").write_text(str(1000 + rank))
        (ranks / f"rank{rank}.exit").write_text(f"{GAVE_UP} at step 10: non-finite loss (inf) at step 9")
    assert every_rank_gave_up(tmp_path)
    (ranks / "rank1.exit").write_text("failed: RuntimeError: boom")
    assert not every_rank_gave_up(tmp_path)
    (ranks / "rank1.exit").unlink()  # killed before it could report
    assert not every_rank_gave_up(tmp_path)


def fabricate(checkpoints: Path, step: int, saved_at: float, world: int = 2, marked: bool = True) -> None:
    tag_dir = checkpoints / tag_for(step)
    tag_dir.mkdir(parents=True)
    (tag_dir / "shard.pt").write_bytes(b"shard")
    if marked:
        (tag_dir / COMPLETE_MARK).write_text(json.dumps({"step": step, "tag": tag_dir.name, "world_size": world,
                                                         "files": ["shard.pt"], "time": saved_at}))


def test_a_rollback_goes_to_the_checkpoint_saved_last_before_the_bad_step(tmp_path):
    fabricate(tmp_path, 2, saved_at=1)
    fabricate(tmp_path, 4, saved_at=2)
    fabricate(tmp_path, 6, saved_at=3, marked=False)  # an interrupted save
    fabricate(tmp_path, 8, saved_at=4)  # from a later, abandoned line of the run (rewound)
    assert rollback_target(tmp_path, bad_step=7, world=2).step == 4
    assert rollback_target(tmp_path, bad_step=4, world=2).step == 2  # step 4 holds the bad step's update
    assert rollback_target(tmp_path, bad_step=2, world=2) is None
    assert rollback_target(tmp_path, bad_step=7, world=4) is None  # another world size's shards


def test_resume_auto_starts_fresh_without_a_complete_checkpoint(tmp_path):
    found, notes = find_resume_auto(tmp_path / "never_created")
    assert found is None and "starting fresh" in notes[0]
    fabricate(tmp_path / CHECKPOINTS, 2, saved_at=1, marked=False)
    assert find_resume_auto(tmp_path)[0] is None


def test_resume_auto_takes_the_last_complete_checkpoint(tmp_path):
    fabricate(tmp_path / CHECKPOINTS, 2, saved_at=1)
    fabricate(tmp_path / CHECKPOINTS, 4, saved_at=2)
    fabricate(tmp_path / CHECKPOINTS, 6, saved_at=3, marked=False)
    (tmp_path / CHECKPOINTS / LATEST).write_text(tag_for(4))
    found, notes = find_resume_auto(tmp_path)
    assert found.step == 4
    assert notes == ["step00000006 is incomplete (its save was interrupted) and is skipped"]


def dry_run(monkeypatch, *args: str):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # the launcher sets it for DeepSpeed; restored after
    monkeypatch.delenv("PL_DEEPSPEED_CONFIG_PATH", raising=False)
    monkeypatch.setenv("COLUMNS", "400")  # no folding of the long temporary path
    result = CliRunner().invoke(app, ["run", "--preset", "stage2", "--accelerator", "cpu", "--gpus", "2",
                                      "--dry-run", *args])
    return result.exit_code, " ".join(result.output.split())


def test_resume_auto_accepts_an_existing_run_dir_without_checkpoints_and_needs_a_run_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a default run directory (runs/...) would appear here
    (tmp_path / "metrics.jsonl").write_text("")  # an earlier attempt died before its first save
    code, output = dry_run(monkeypatch, "--run-dir", str(tmp_path), "--resume", "auto")
    assert code == 0, output
    assert f"--resume auto: no complete checkpoint in {tmp_path / CHECKPOINTS} yet; starting fresh" in output
    code, output = dry_run(monkeypatch, "--resume", "auto")
    assert code == 2
    assert "--resume auto: --resume auto continues the run in --run-dir, but no --run-dir was given" in output


# ------------------------------------------------------------------ time-based saves and early stop

def test_the_save_clock_is_due_after_its_period_and_again_after_a_save():
    now = [0.0]
    clock = SaveClock(minutes=2, clock=lambda: now[0])
    now[0] = 119.0
    assert not clock.due()
    now[0] = 120.0
    assert clock.due()
    clock.saved()
    assert not clock.due()
    assert not SaveClock(minutes=None).due()


def test_early_stop_counts_evaluations_without_improvement_beyond_min_delta():
    early = EarlyStop(patience=2, min_delta=0.1)
    assert not early.update(10, 3.0)
    assert not early.update(20, 2.95)  # not better by more than 0.1
    assert early.update(30, 2.99)
    assert (early.best, early.best_step, early.since_best) == (3.0, 10, 2)
    resumed = EarlyStop(patience=2)
    resumed.restore(early.client_state())
    assert not resumed.update(40, 1.0) and resumed.best_step == 40


def test_early_stop_is_off_without_patience():
    early = EarlyStop(patience=None)
    assert not any(early.update(step, 5.0) for step in range(10))


# ------------------------------------------------------------------ config checks

@pytest.mark.parametrize("setting, message", [
    ("train.spike_factor=1.0", "train.spike_factor: Input should be greater than 1"),
    ("train.spike_window=1", "train.spike_window: Input should be greater than or equal to 2"),
    ("train.max_rollbacks=-1", "train.max_rollbacks: Input should be greater than or equal to 0"),
    ("train.save_every_minutes=0", "train.save_every_minutes: Input should be greater than 0"),
    ("train.early_stop_patience=0", "train.early_stop_patience: Input should be greater than 0"),
])
def test_impossible_health_settings_are_rejected(setting, message):
    result = CliRunner().invoke(app, ["config", "--accelerator", "cpu", "--gpus", "2", "--set", setting])
    assert result.exit_code == 2
    assert message in " ".join(result.stderr.split())


def test_time_based_saves_need_checkpoints():
    result = CliRunner().invoke(app, ["config", "--accelerator", "cpu", "--gpus", "2", "--set",
                                      "train.save_every_minutes=30", "--set", "train.save_checkpoints=false"])
    assert result.exit_code == 2
    assert "save_every_minutes asks for time-based checkpoints, but save_checkpoints is false" in result.stderr


# ------------------------------------------------------------------ through the real launcher

def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def items_of(data_step_index: int, train_items: int, global_batch: int, seed: int = 1234) -> list[int]:
    """The dataset items a data step trains on (tests/user_code/usermods.numbered_pairs numbers them)."""
    samples = samples_of(data_step_index, global_batch)
    return DatasetSampler(list(range(train_items)), seed).batch(samples.start, len(samples)).tolist()


POISON_SETS = ("model.name=usermods:poisoned", "data.source=usermods:numbered_pairs", "data.kwargs={size: 1000}",
               "data.seq_len=1", "train.micro_batch_size=4", "train.schedule=constant", "train.lr=0.05",
               "train.weight_decay=0", "train.log_every=2", "train.eval_batches=2",
               # checkpoints by the clock alone: 0.0001 minutes is always due, so the ranks' vote (cast at one
               # step, agreed at the next) saves at every second step; save_every never comes
               "train.save_every=100", "train.save_every_minutes=0.0001")


def poisoned_run(run_dir: Path, poison: list[int], *sets: str):
    """`dstrain run --resume auto` of the poisoned user model on 2 CPU ranks. 1000 items, 950 for training:
    one epoch is 118 steps, so no item comes back within these runs."""
    args = ["run", "--preset", "stage2", "--accelerator", "cpu", "--gpus", "2", "--run-dir", str(run_dir),
            "--resume", "auto"]
    for item in (*POISON_SETS, f"model.kwargs={{poison: {poison}}}", *sets):
        args += ["--set", item]
    return dstrain(*args, cwd=USER_CODE, env={"COLUMNS": "250"})  # in this process, from the user's folder


@pytest.fixture(scope="module")
def gave_up(tmp_path_factory):
    """One launch, started as a requeued job (`--resume auto` in an empty run directory), that rolls back
    once and then gives up. One item of step 5 (data step 4, samples 32-39) and one of step 9 once step 5's
    data is skipped (data step 9, samples 72-79): each makes its batch's loss infinite. With
    train.max_rollbacks=1 the first rolls back to step 4 and the second, at step 9, ends the run (exit 1).
    What the tests read is kept here, before `continued` adds to the run directory."""
    run_dir = tmp_path_factory.mktemp("health") / "run"
    run_dir.mkdir()  # a requeued job: the directory exists, nothing is in it yet
    poison = [items_of(4, 950, 8)[0], items_of(9, 950, 8)[0]]
    result = poisoned_run(run_dir, poison, "train.max_steps=12", "train.max_rollbacks=1", "train.eval_every=8")
    return SimpleNamespace(run_dir=run_dir, poison=poison, result=result, events=events(run_dir),
                           output=" ".join((result.stdout + result.stderr).split()),
                           latest=(run_dir / CHECKPOINTS / LATEST).read_text(),
                           health=json.loads((run_dir / HEALTH).read_text()))


@pytest.fixture(scope="module")
def continued(gave_up):
    """What the give-up report advises: the same command with train.max_rollbacks raised (and more steps,
    evaluations every 2 steps, early stopping) continues the run from its last checkpoint."""
    result = poisoned_run(gave_up.run_dir, gave_up.poison, "train.max_steps=20", "train.max_rollbacks=2",
                          "train.eval_every=2", "train.early_stop_patience=2", "train.early_stop_min_delta=100")
    return SimpleNamespace(result=result, events=events(gave_up.run_dir),
                           output=" ".join((result.stdout + result.stderr).split()))


@pytest.mark.integration
def test_an_inf_loss_rolls_back_skips_its_samples_and_a_second_one_past_max_rollbacks_gives_up(gave_up):
    """Reads `gave_up`."""
    assert gave_up.result.returncode == 1, gave_up.output[-3000:]
    rollbacks = [r for r in gave_up.events if r.get("event") == "rollback"]
    assert len(rollbacks) == 1
    assert {k: rollbacks[0][k] for k in ("from_step", "to_step", "bad_step", "skipped_samples")} == \
        {"from_step": 6, "to_step": 4, "bad_step": 5, "skipped_samples": [32, 40]}
    losses = {r["step"]: r["loss"] for r in gave_up.events if "loss" in r}
    assert sorted(losses) == [2, 4, 6, 8] and all(math.isfinite(v) for v in losses.values())
    assert gave_up.health["skipped_data_steps"] == [4]
    assert "non-finite loss (inf) at step 5; rolled back from step 6 to step00000004, skipping global " \
           "samples 32-39" in " ".join(gave_up.result.stdout.split())

    # Step 9 trains on data step 9 (step 5's data is skipped), meets the second poisoned item, and with
    # max_rollbacks=1 already used the run gives up with a report and exit code 1.
    assert ("run health: gave up at step 10: non-finite loss (inf) at step 9 (global samples 72-79); "
            "train.max_rollbacks is 1 and 1 rollback(s) were made") in gave_up.output
    assert "rollback 1: non-finite loss (inf) at step 5; back from step 6 to step 4, skipped global samples " \
           "32-39" in gave_up.output
    assert [(r["step"], r["bad_step"], r["samples"]) for r in gave_up.events if r.get("event") == "gave_up"] == \
        [(10, 9, [72, 80])]
    assert gave_up.latest == tag_for(8)  # nothing of the bad steps was saved


@pytest.mark.integration
def test_resume_auto_starts_fresh_in_an_empty_run_dir_and_saves_by_the_clock(gave_up):
    """Reads `gave_up`: its checkpoints, step 4 (rolled back to) and step 8 (the last), came from the clock."""
    assert "--resume auto: no complete checkpoint" in gave_up.result.stdout
    assert "checkpoint step00000002 saved" in gave_up.result.stdout  # by the clock: save_every is 100
    assert [r["to_step"] for r in gave_up.events if r.get("event") == "rollback"] == [4]
    assert gave_up.latest == tag_for(8)


@pytest.mark.integration
def test_resume_auto_continues_with_the_skips_and_rollbacks_made_and_stops_early(gave_up, continued):
    """Reads `continued`, which resumes `gave_up`'s run."""
    assert_ok(continued.result)
    assert "resumed from step00000008 at step 8" in continued.output
    # The skip came back with the checkpoint: step 9 trains on data step 9 again and meets its poisoned
    # item; the rollback made before counts, so this one is the second of the two now allowed.
    assert "non-finite loss (inf) at step 9; rolled back from step 10 to step00000008, skipping global samples " \
           "72-79 (rollback 2 of at most 2)" in continued.output
    rollbacks = [r for r in continued.events if r.get("event") == "rollback"]
    assert [(r["from_step"], r["to_step"], r["bad_step"], r["skipped_samples"]) for r in rollbacks] == \
        [(6, 4, 5, [32, 40]), (10, 8, 9, [72, 80])]
    assert json.loads((gave_up.run_dir / HEALTH).read_text())["skipped_data_steps"] == [4, 9]
    # The best eval loss so far is step 8's, from the first launch; none improves on it by 100, so the evals
    # at steps 10 and 12 end the run at step 12, with a checkpoint. (Had the early-stop count not come back
    # with the checkpoint, step 10's eval would be the best and the run would stop at step 14.)
    assert "early stop at step 12: the eval loss has not improved for 2 evaluation(s)" in continued.output
    assert (gave_up.run_dir / CHECKPOINTS / LATEST).read_text() == tag_for(12)
    assert [r["step"] for r in continued.events if r.get("event") == "early_stop"] == [12]
    assert max(r["step"] for r in continued.events if "loss" in r) == 12
    assert all(math.isfinite(r["loss"]) for r in continued.events if "loss" in r)
