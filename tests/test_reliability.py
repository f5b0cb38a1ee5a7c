"""Reliability (issue 7): a run that meets a dead rank, a kill in the middle of a save, a preemption
signal, a full or unwritable disk, a broken environment variable or a secret in its config ends
clearly, leaves nothing running and nothing that resumes wrongly, and resumes from what it saved.

Unit tests fabricate checkpoint directories; the `integration` tests start real CPU ranks through
`dstrain run` and the deepspeed launcher, and share one job per scenario (module-scoped fixtures).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from dstrain.checkpoints import (CHECKPOINTS, COMPLETE_MARK, LATEST, complete_checkpoints, find_resume, prune,
                                 tag_for, verify)
from dstrain.errors import UserError
from launcher import TINY

TESTS = Path(__file__).parent
SHARDS = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
          "zero_pp_rank_1_mp_rank_00_optim_states.pt", "rng_rank0.pt", "rng_rank1.pt")


# ------------------------------------------------------------------ fabricated checkpoints (unit)

def fabricate(checkpoints: Path, step: int, *, marked: bool = True, saved_at: float | None = None,
              missing: tuple[str, ...] = ()) -> Path:
    """A tag directory as two ranks leave it: shard files, and the completion mark if `marked`."""
    tag_dir = checkpoints / tag_for(step)
    tag_dir.mkdir(parents=True)
    for name in SHARDS:
        (tag_dir / name).write_bytes(b"shard")
    if marked:
        mark = {"step": step, "tag": tag_dir.name, "world_size": 2, "files": list(SHARDS),
                "time": saved_at if saved_at is not None else 1000.0 + step, "config_hash": "h"}
        (tag_dir / COMPLETE_MARK).write_text(json.dumps(mark))
    for name in missing:
        (tag_dir / name).unlink()
    return tag_dir


def point_latest(checkpoints: Path, step: int) -> None:
    (checkpoints / LATEST).write_text(tag_for(step))


def test_resume_skips_a_newer_checkpoint_without_its_mark_and_says_so(tmp_path):
    checkpoints = tmp_path / CHECKPOINTS
    fabricate(checkpoints, 2)
    fabricate(checkpoints, 4, marked=False)  # killed after the shards, before the mark
    point_latest(checkpoints, 2)
    found, notes = find_resume("latest", tmp_path)
    assert found.tag == "step00000002"
    assert notes == ["step00000004 is incomplete (its save was interrupted) and is skipped"]


def test_resume_skips_a_checkpoint_whose_listed_file_is_missing(tmp_path):
    checkpoints = tmp_path / CHECKPOINTS
    fabricate(checkpoints, 2)
    fabricate(checkpoints, 4, missing=("rng_rank1.pt",))
    point_latest(checkpoints, 4)
    found, notes = find_resume("latest", tmp_path)
    assert found.tag == "step00000002"
    assert notes == ["'latest' names step00000004, which is damaged (rng_rank1.pt missing); resuming from "
                     "step00000002, the newest intact checkpoint"]


def test_resume_takes_a_complete_checkpoint_that_latest_does_not_name_yet(tmp_path):
    checkpoints = tmp_path / CHECKPOINTS
    fabricate(checkpoints, 2)
    fabricate(checkpoints, 4)  # killed between the mark and the move of `latest`
    point_latest(checkpoints, 2)
    found, notes = find_resume("latest", tmp_path)
    assert found.tag == "step00000004"
    assert "'latest' names step00000002, but step00000004 was saved completely after it" in notes[0]


def test_resume_after_a_rewind_takes_the_last_checkpoint_saved_not_the_highest_step(tmp_path):
    checkpoints = tmp_path / CHECKPOINTS
    fabricate(checkpoints, 8, saved_at=100.0)  # the first timeline
    fabricate(checkpoints, 6, saved_at=200.0)  # saved after `--resume step00000004`
    point_latest(checkpoints, 6)
    found, notes = find_resume("latest", tmp_path)
    assert (found.tag, notes) == ("step00000006", [])


def test_resume_of_an_unmarked_tag_directory_is_refused(tmp_path):
    fabricate(tmp_path / CHECKPOINTS, 4, marked=False)
    with pytest.raises(UserError, match="this checkpoint is incomplete"):
        find_resume(str(tmp_path / CHECKPOINTS / "step00000004"), tmp_path)


def test_resume_with_only_incomplete_checkpoints_is_refused(tmp_path):
    fabricate(tmp_path / CHECKPOINTS, 2, marked=False)
    with pytest.raises(UserError, match="no complete checkpoint"):
        find_resume("latest", tmp_path)


@pytest.mark.parametrize("mark", ["", "[]", "{not json", '{"step": 4}', '{"step": "four", "world_size": 2, '
                                  '"files": [], "time": 1.0}', '{"step": 4, "world_size": 2, "files": 7, "time": 1.0}'])
def test_a_damaged_or_foreign_mark_counts_as_incomplete(tmp_path, mark):
    tag_dir = fabricate(tmp_path, 4, marked=False)
    (tag_dir / COMPLETE_MARK).write_text(mark)
    assert verify(tag_dir) is None


def test_prune_keep_last_1_keeps_the_only_complete_checkpoint_beside_a_newer_incomplete_one(tmp_path):
    fabricate(tmp_path, 2)
    fabricate(tmp_path, 4)
    fabricate(tmp_path, 6, marked=False)  # a save in progress, or interrupted
    removed = prune(tmp_path, keep_last=1)
    assert [p.name for p in removed] == ["step00000002"]
    assert [c.tag for c in complete_checkpoints(tmp_path)] == ["step00000004"]
    assert (tmp_path / "step00000006").is_dir()


def test_prune_never_deletes_the_only_complete_checkpoint(tmp_path):
    fabricate(tmp_path, 2)
    fabricate(tmp_path, 4, missing=("rng_rank0.pt",))
    fabricate(tmp_path, 6, marked=False)
    assert prune(tmp_path, keep_last=1) == []
    assert [c.tag for c in complete_checkpoints(tmp_path)] == ["step00000002"]


def test_prune_deletes_old_incomplete_directories_and_keeps_the_last_n(tmp_path):
    for step in (2, 4, 6):
        fabricate(tmp_path, step)
    fabricate(tmp_path, 3, marked=False)
    removed = prune(tmp_path, keep_last=2)
    assert sorted(p.name for p in removed) == ["step00000002", "step00000003"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step00000004", "step00000006"]


# ------------------------------------------------------------------ checkpoint.save with a stand-in engine

class StandInEngine:
    """Writes what DeepSpeed's save_checkpoint writes (one file per shard), then fails if told to."""

    def __init__(self, fail_with: BaseException | None = None):
        self.fail_with = fail_with

    def save_checkpoint(self, directory, tag, client_state, save_latest):
        tag_dir = Path(directory) / tag
        tag_dir.mkdir(parents=True, exist_ok=True)
        (tag_dir / "mp_rank_00_model_states.pt").write_bytes(b"new")
        if self.fail_with is not None:
            raise self.fail_with


def test_save_marks_and_points_latest_only_after_every_file(tmp_path, one_rank_group):
    from dstrain.rank.checkpointing import save
    saved = save(StandInEngine(), tmp_path, 2, {"config_hash": "h"}, keep_last=2)
    assert (tmp_path / CHECKPOINTS / LATEST).read_text() == "step00000002"
    assert sorted(json.loads((saved / COMPLETE_MARK).read_text())["files"]) == ["mp_rank_00_model_states.pt",
                                                                                "rng_rank0.pt"]


def test_a_kill_during_save_leaves_latest_on_the_previous_complete_checkpoint(tmp_path, one_rank_group):
    from dstrain.rank.checkpointing import save
    save(StandInEngine(), tmp_path, 2, {}, keep_last=2)
    with pytest.raises(KeyboardInterrupt):  # stands for the process dying inside save_checkpoint
        save(StandInEngine(fail_with=KeyboardInterrupt()), tmp_path, 4, {}, keep_last=2)
    checkpoints = tmp_path / CHECKPOINTS
    assert (checkpoints / LATEST).read_text() == "step00000002"
    assert not (checkpoints / "step00000004" / COMPLETE_MARK).exists()
    assert find_resume("latest", tmp_path)[0].tag == "step00000002"


def test_saving_a_tag_again_unmarks_it_first(tmp_path, one_rank_group):
    """A run rewound with --resume step00000002 reaches step 4 again: the old step 4 must not look
    complete (nor be `latest`) while its files are being replaced."""
    from dstrain.rank.checkpointing import save
    checkpoints = tmp_path / CHECKPOINTS
    fabricate(checkpoints, 2)
    fabricate(checkpoints, 4)
    point_latest(checkpoints, 4)
    with pytest.raises(KeyboardInterrupt):
        save(StandInEngine(fail_with=KeyboardInterrupt()), tmp_path, 4, {}, keep_last=2)
    assert verify(checkpoints / "step00000004") is None
    assert (checkpoints / LATEST).read_text() == "step00000002"
    assert find_resume("latest", tmp_path)[0].tag == "step00000002"


def test_a_full_disk_during_save_is_an_error_naming_the_checkpoint(tmp_path, one_rank_group):
    from dstrain.rank.checkpointing import save
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    with pytest.raises(UserError) as caught:
        save(StandInEngine(fail_with=full), tmp_path, 2, {}, keep_last=2)
    message = str(caught.value)
    assert f"{tmp_path / CHECKPOINTS / 'step00000002'}: writing the checkpoint failed" in message
    assert "No space left on device" in message and "--resume latest" in message
    assert not (tmp_path / CHECKPOINTS / LATEST).exists()


def test_a_failed_collective_during_save_is_not_reported_as_a_disk_problem(tmp_path, one_rank_group):
    from dstrain.rank.checkpointing import save
    peer_died = RuntimeError("Connection closed by peer [127.0.0.1]:29500")
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        save(StandInEngine(fail_with=peer_died), tmp_path, 2, {}, keep_last=2)


# ------------------------------------------------------------------ secrets in what dstrain prints

SECRET = "comet-key-0123456789"
WITH_SECRET = ["--set", "deepspeed.comet.enabled=false", "--set", f"deepspeed.comet.api_key={SECRET}"]


@pytest.mark.parametrize("flags", [[], ["--explain"], ["--deepspeed-json"]])
def test_dstrain_config_never_prints_a_secret(flags, monkeypatch):
    from typer.testing import CliRunner
    from dstrain.cli import app
    monkeypatch.delenv("PL_DEEPSPEED_CONFIG_PATH", raising=False)
    result = CliRunner().invoke(app, ["config", "--preset", "stage2", "--accelerator", "cpu", "--gpus", "2",
                                      *WITH_SECRET, *flags])
    assert result.exit_code == 0, result.output
    assert SECRET not in result.output
    if flags:
        assert "<redacted>" in result.output


def test_the_plan_of_a_dry_run_never_prints_a_secret(tmp_path, monkeypatch):
    from typer.testing import CliRunner
    from dstrain.cli import app
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.delenv("PL_DEEPSPEED_CONFIG_PATH", raising=False)
    result = CliRunner().invoke(app, ["run", "--preset", "stage2", "--accelerator", "cpu", "--gpus", "2", "--dry-run",
                                      "--run-dir", str(tmp_path / "run"), *WITH_SECRET])
    assert result.exit_code == 0, result.output
    assert "would run:" in result.output and SECRET not in result.output


def test_rank_environment_gets_a_cuda_arch_list_deepspeed_can_parse(monkeypatch):
    from dstrain.launcher.runner import rank_env as _rank_env
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0 9.0a 10.0a+PTX")
    env = _rank_env("cuda", 8)
    assert env["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0;10.0+PTX"
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0 9.0a 10.0a+PTX"  # only the ranks' copy is changed


# ------------------------------------------------------------------ jobs through the real launcher

@dataclass
class Job:
    """One `dstrain run` in the background; its output goes to a file (no pipe to fill)."""

    process: subprocess.Popen
    run_dir: Path
    log: Path

    @classmethod
    def start(cls, run_dir: Path, *sets: str, preset: str = "stage2", resume: str | None = None,
              extra: tuple[str, ...] = (), env: dict[str, str] | None = None) -> "Job":
        args = [sys.executable, "-m", "dstrain.cli", "run", "--preset", preset, "--accelerator", "cpu",
                "--gpus", "2", "--run-dir", str(run_dir), *extra]
        for item in (*TINY, "train.eval_every=100000", "train.log_every=1", *sets):
            args += ["--set", item]
        if resume:
            args += ["--resume", resume]
        log = run_dir.parent / f"{run_dir.name}-{len(list(run_dir.parent.glob(run_dir.name + '-*.log')))}.log"
        with open(log, "w") as out:
            process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                       env={**os.environ, **(env or {})})
        return cls(process, run_dir, log)

    @property
    def output(self) -> str:
        return self.log.read_text()

    @staticmethod
    def run_to_the_end(run_dir: Path, *sets: str, resume: str | None = None) -> subprocess.CompletedProcess:
        """The same command run to its end in this process (launcher.dstrain): for a run that no signal
        interrupts, no fresh interpreter importing torch and DeepSpeed."""
        from launcher import dstrain
        args = ["run", "--preset", "stage2", "--accelerator", "cpu", "--gpus", "2", "--run-dir", str(run_dir),
                *(["--resume", resume] if resume else [])]
        for item in (*TINY, "train.eval_every=100000", "train.log_every=1", *sets):
            args += ["--set", item]
        return dstrain(*args, timeout=300)

    def wait_for(self, condition, what: str, timeout: float = 240) -> None:
        end = time.monotonic() + timeout
        while not condition():
            if self.process.poll() is not None:
                raise AssertionError(f"the job ended (exit {self.process.returncode}) before {what}:\n{self.output}")
            if time.monotonic() > end:
                self.process.kill()
                raise AssertionError(f"no {what} within {timeout} s:\n{self.output}")
            time.sleep(0.05)

    def finish(self, timeout: float) -> float:
        """Wait for the job to end; returns the seconds it took."""
        started = time.monotonic()
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"still running after {timeout} s:\n{self.output}")
        return time.monotonic() - started


def rank_processes(run_dir: Path) -> list[int]:
    """Pids of live rank processes of this run (its resolved path is their last argument)."""
    needle = b"\0" + str(run_dir.resolve()).encode() + b"\0"
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if proc.name.isdigit() and b"dstrain.rank.worker" in cmdline and needle in b"\0" + cmdline:
            pids.append(int(proc.name))
    return pids


def latest_tag(run_dir: Path) -> str | None:
    try:
        return (run_dir / CHECKPOINTS / LATEST).read_text().strip()
    except OSError:
        return None


def metric_steps(run_dir: Path) -> list[int]:
    try:
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    except (OSError, ValueError):
        return []
    return [row["step"] for row in rows if "loss" in row]


@dataclass
class Ended:
    """How a job ended, captured the moment it did (before any later test touches its directory)."""

    code: int
    seconds: float
    output: str
    latest: str | None
    leftover: list[int]


def ended(job: Job, seconds: float) -> Ended:
    return Ended(job.process.returncode, seconds, flat(job.output), latest_tag(job.run_dir),
                 rank_processes(job.run_dir))


def flat(text: str) -> str:
    """Output with its line wrapping undone (rich wraps messages at 80 columns when not on a terminal)."""
    return " ".join(text.split())


def runner_started(run_dir: Path) -> bool:
    """DeepSpeed's launcher of this run is up (its last argument is the run directory)."""
    needle = b"\0" + str(run_dir.resolve()).encode() + b"\0"
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if (b"deepspeed.launcher.runner" in cmdline or b"deepspeed.launcher.launch" in cmdline) and needle in b"\0" + cmdline:
            return True
    return False


# -------- a rank killed with SIGKILL, while its second save is in progress

@pytest.fixture(scope="module")
def killed_rank(tmp_path_factory):
    """Rank 1 is held inside its step-6 save (its RNG file is a FIFO nobody reads: open() blocks) after
    rank 0 wrote all of its files, then killed with SIGKILL: a rank lost after two checkpoints,
    and a save interrupted with a tag directory that has shards but no mark."""
    run_dir = tmp_path_factory.mktemp("killed") / "run"
    held = run_dir / CHECKPOINTS / "step00000006"
    held.mkdir(parents=True)
    os.mkfifo(held / "rng_rank1.pt")
    job = Job.start(run_dir, "train.max_steps=1000", "train.save_every=2")
    job.wait_for(lambda: latest_tag(run_dir) == "step00000004" and (held / "rng_rank0.pt").exists(),
                 "two checkpoints and rank 0's part of the third")
    os.kill(int((run_dir / "ranks" / "rank1.pid").read_text()), signal.SIGKILL)
    result = ended(job, job.finish(timeout=120))
    print(f"job ended {result.seconds:.1f} s after SIGKILL of rank 1 (exit {result.code})")
    return job, result


@pytest.mark.integration
def test_a_killed_rank_ends_the_job_within_90_s_naming_the_rank(killed_rank):
    _, result = killed_rank
    assert result.code != 0, result.output
    assert result.seconds < 90, result.output
    assert "training failed" in result.output
    assert "rank 1 died without reporting (killed by a signal such as SIGKILL" in result.output
    assert "rank 0 died" not in result.output  # rank 0 was stopped because of rank 1: not blamed


@pytest.mark.integration
def test_a_killed_rank_leaves_no_rank_process_running(killed_rank):
    assert killed_rank[1].leftover == []


@pytest.mark.integration
def test_a_save_killed_midway_leaves_latest_on_the_last_complete_checkpoint(killed_rank):
    job, result = killed_rank
    held = job.run_dir / CHECKPOINTS / "step00000006"
    assert result.latest == "step00000004"
    assert verify(job.run_dir / CHECKPOINTS / "step00000004") is not None
    assert (held / "rng_rank0.pt").exists() and not (held / COMPLETE_MARK).exists()


@pytest.mark.integration
def test_resume_after_a_killed_rank_skips_the_interrupted_and_a_truncated_tag(killed_rank):
    """Besides the interrupted step-6 save, the newest complete tag (step 4) loses the end of an
    optimizer shard: `checkpoint verify` names it, and --resume latest falls back to step 2."""
    import hashlib
    from launcher import dstrain
    job, _ = killed_rank
    checkpoints = job.run_dir / CHECKPOINTS
    held = checkpoints / "step00000006" / "rng_rank1.pt"
    held.unlink()
    held.write_bytes(b"PK\x03\x04 half a file")  # what a rank killed mid-write leaves
    shard = checkpoints / "step00000004" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shard.write_bytes(shard.read_bytes()[:1000])
    good, bad = (dstrain("checkpoint", "verify", str(checkpoints / tag), timeout=60) for tag in ("step00000002",
                                                                                               "step00000004"))
    assert good.returncode == 0 and "intact (sizes and SHA-256 match)" in flat(good.stdout), good.stdout
    assert bad.returncode == 2 and f"damaged: {shard} truncated: 1000 bytes" in flat(bad.stdout), bad.stdout

    resumed = Job.run_to_the_end(job.run_dir, "train.max_steps=6", "train.save_every=2", resume="latest")
    resumed_output = resumed.stdout + resumed.stderr
    output = flat(resumed_output)
    assert resumed.returncode == 0, resumed_output
    assert ("'latest' names step00000004, which is damaged (zero_pp_rank_1_mp_rank_00_optim_states.pt truncated: "
            "1000 bytes") in output
    assert "step00000006 is incomplete (its save was interrupted) and is skipped" in output
    assert "resumed from step00000002 at step 2" in resumed_output
    assert metric_steps(job.run_dir)[-4:] == [3, 4, 5, 6]
    assert latest_tag(job.run_dir) == "step00000006"
    assert verify(checkpoints / "step00000004") is not None  # saved again, whole this time
    files = json.loads((checkpoints / "step00000006" / COMPLETE_MARK).read_text())["files"]
    for rank in (0, 1):  # each rank hashed its own shard; rank 0 gathered both records into the mark
        data = (checkpoints / "step00000006" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").read_bytes()
        assert files[f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"] == {
            "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


# -------- preemption: SIGTERM to `dstrain run` in the middle of training

@pytest.fixture(scope="module")
def terminated(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("sigterm") / "run"
    job = Job.start(run_dir, "train.max_steps=100000", "train.save_every=100000")
    job.wait_for(lambda: len(metric_steps(run_dir)) >= 3, "three training steps")
    job.process.send_signal(signal.SIGTERM)
    result = ended(job, job.finish(timeout=150))
    print(f"job ended {result.seconds:.1f} s after SIGTERM (exit {result.code}, checkpoint {result.latest})")
    return job, result


@pytest.mark.integration
def test_sigterm_saves_and_exits_143_within_120_s(terminated):
    _, result = terminated
    assert result.code == 143, result.output
    assert result.seconds < 120
    assert "SIGTERM: asking the ranks to save a checkpoint and stop" in result.output
    assert "stopped cleanly after a checkpoint; continue with --resume latest" in result.output
    assert "stopped by SIGTERM at step" in result.output and "SIGINT" not in result.output
    assert result.leftover == []


@pytest.mark.integration
def test_sigterm_checkpoint_is_complete_and_at_the_step_training_stopped(terminated):
    job, result = terminated
    found = verify(job.run_dir / CHECKPOINTS / result.latest)
    assert found is not None
    assert found.step == metric_steps(job.run_dir)[-1] < 100000


@pytest.mark.integration
def test_resume_after_sigterm_continues_from_its_checkpoint(terminated):
    job, result = terminated
    step = verify(job.run_dir / CHECKPOINTS / result.latest).step
    resumed = Job.run_to_the_end(job.run_dir, f"train.max_steps={step + 2}", "train.save_every=100000", resume="latest")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resumed from {tag_for(step)} at step {step}" in resumed.stdout
    assert metric_steps(job.run_dir)[-2:] == [step + 1, step + 2]
    assert latest_tag(job.run_dir) == tag_for(step + 2)


# -------- SIGINT right after launch, before any rank has started; a secret and a broken arch list


@pytest.fixture(scope="module")
def interrupted_early(tmp_path_factory):
    """Ctrl-C as soon as `dstrain run` starts the launcher: the ranks are not even up, so the request
    must wait for them. The run also carries an API key and a TORCH_CUDA_ARCH_LIST DeepSpeed cannot
    parse, and its model records what each rank sees (tests/rank_recorder.py)."""
    base = tmp_path_factory.mktemp("sigint")
    run_dir, seen = base / "run", base / "seen"
    seen.mkdir()
    model = ["model.name=rank_recorder:build", f"model.kwargs.record_dir={seen}", "model.kwargs.vocab_size=256",
             "model.kwargs.seq_len=32", "model.kwargs.d_model=32", "model.kwargs.n_layer=1", "model.kwargs.n_head=2"]
    monitor = ["deepspeed.comet.enabled=false", f"deepspeed.comet.api_key={SECRET}", "deepspeed.comet.project=p"]
    # Without the early start: the launcher then starts after the checks, with the run directory
    # written, and its ranks are surely not up yet. (Early-started ranks wait at a gate during the
    # checks, where a signal ends the job unsaved: tests/test_early_start.py.)
    job = Job.start(run_dir, "train.max_steps=100000", "train.save_every=100000", *model, *monitor,
                    env={"PYTHONPATH": str(TESTS), "TORCH_CUDA_ARCH_LIST": "9.0a;8.0,8.0", "DSTRAIN_EARLY_START": "0"})
    job.wait_for(lambda: runner_started(run_dir), "the deepspeed runner starting")
    ranks_up = sorted(p.name for p in (run_dir / "ranks").glob("*.pid"))
    job.process.send_signal(signal.SIGINT)
    result = ended(job, job.finish(timeout=150))
    print(f"job ended {result.seconds:.1f} s after SIGINT (exit {result.code}, checkpoint {result.latest})")
    return job, result, seen, ranks_up


@pytest.mark.integration
def test_sigint_before_the_ranks_are_up_still_saves_and_exits_130(interrupted_early):
    job, result, _, ranks_up = interrupted_early
    assert ranks_up == []  # the signal came before any rank had started
    assert result.code == 130, result.output
    assert result.seconds < 120
    assert "SIGINT: asking the ranks to save a checkpoint and stop" in result.output
    found = verify(job.run_dir / CHECKPOINTS / result.latest)
    assert found is not None and found.step == metric_steps(job.run_dir)[-1] < 100000
    assert result.leftover == []


@pytest.mark.integration
def test_ranks_see_a_sanitised_cuda_arch_list(interrupted_early):
    _, result, seen, _ = interrupted_early
    for rank in (0, 1):
        env = json.loads((seen / f"{rank}.json").read_text())["env"]
        assert env["TORCH_CUDA_ARCH_LIST"] == "9.0;8.0"
    assert "TORCH_CUDA_ARCH_LIST='9.0a;8.0,8.0' rewritten to '9.0;8.0'" in result.output


@pytest.mark.integration
def test_ranks_get_the_real_secret(interrupted_early):
    _, _, seen, _ = interrupted_early
    for rank in (0, 1):
        assert json.loads((seen / f"{rank}.json").read_text())["ds_config"]["comet"]["api_key"] == SECRET


@pytest.mark.integration
def test_the_secret_is_in_no_file_of_the_run_but_the_private_one(interrupted_early):
    job, result, _, _ = interrupted_early
    assert SECRET not in result.output
    assert any((job.run_dir / CHECKPOINTS / result.latest).glob("*.pt"))  # checkpoint files are scanned too
    holders = [p.relative_to(job.run_dir) for p in job.run_dir.rglob("*") if p.is_file()
               and SECRET.encode() in p.read_bytes()]
    assert holders == [Path(".secrets.json")]  # not config.yaml, ds_config.json, nor any checkpoint file
    assert stat.S_IMODE((job.run_dir / ".secrets.json").stat().st_mode) == 0o600
    assert json.loads((job.run_dir / "ds_config.json").read_text())["comet"]["api_key"] == "<redacted>"


# -------- a disk that fills up

@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB tmpfs: room for the run's config files, not for a checkpoint (about 400 KiB here)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.integration
def test_a_full_disk_ends_the_job_with_the_checkpoint_path_and_the_cause(small_disk):
    run_dir = small_disk / "run"
    job = Job.run_to_the_end(run_dir, "train.max_steps=4", "train.save_every=2")
    output = flat(job.stdout + job.stderr)
    assert job.returncode != 0, output
    assert f"{run_dir / CHECKPOINTS / 'step00000002'}: writing the checkpoint failed: the disk is full" in output
    assert "training failed" in output and "continue with --resume latest" in output
    assert latest_tag(run_dir) is None and complete_checkpoints(run_dir / CHECKPOINTS) == []
    assert rank_processes(run_dir) == []


# ------------------------------------------------------------------ a run directory that cannot be written

def run_fails_before_launch(run_dir: Path | str) -> str:
    from launcher import dstrain
    done = dstrain("run", "--preset", "stage2", "--accelerator", "cpu", "--gpus", "2", "--run-dir", str(run_dir),
                   *[a for s in TINY for a in ("--set", s)], timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert "run directory:" not in done.stdout  # nothing was started
    return done.stderr


@pytest.mark.slow
def test_run_dir_under_proc_is_refused_clearly():
    message = run_fails_before_launch("/proc/1/dstrain-run")
    assert "--run-dir /proc/1/dstrain-run: cannot write the run directory" in message


@pytest.mark.slow
def test_run_dir_that_is_a_file_is_refused_clearly(tmp_path):
    path = tmp_path / "run"
    path.write_text("not a directory")
    assert f"--run-dir {path}: is a file, not a directory" in run_fails_before_launch(path)


@pytest.mark.slow
def test_read_only_run_dir_is_refused_clearly(tmp_path):
    mount = tmp_path / "ro"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        message = run_fails_before_launch(mount / "run")
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
    assert f"--run-dir {mount / 'run'}: cannot write the run directory: Read-only file system" in message


def test_deepspeed_cpu_allreduce_buffers_of_the_jobs_port_are_removed_before_it_starts():
    """A rank maps the other ranks' /dev/shm all-reduce buffers by name as soon as they exist: one left
    by an earlier job on the same port would be read before its new owner writes it."""
    from dstrain.launcher.supervise import start_launcher
    port = f"7{os.getpid()}"
    stale = [Path("/dev/shm") / f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_{rank}" for rank in (0, 1)]
    other = Path("/dev/shm") / f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}1_0"  # another job's port
    try:
        for path in stale + [other]:
            path.write_bytes(b"x")
        process = start_launcher([sys.executable, "-c", "pass", "--master_port", port], dict(os.environ))
        assert process.wait(timeout=60) == 0
        assert not any(path.exists() for path in stale) and other.exists()
    finally:
        for path in stale + [other]:
            path.unlink(missing_ok=True)


def test_a_rank_ends_as_pythons_exit_would_without_the_interpreters_teardown():
    """exit_without_teardown (the worker's exit; a gloo thread freeing a collective's tensors during the
    teardown aborted ranks): it still waits for a non-daemon thread, stops a thread pool's idle
    worker (else the join would hang), runs the atexit handlers, flushes the output, and exits with
    the rank's code."""
    code = textwrap.dedent("""
        import atexit, concurrent.futures, sys, threading, time
        from dstrain.rank.runtime import exit_without_teardown
        pool = concurrent.futures.ThreadPoolExecutor(2)
        pool.submit(lambda: None).result()
        threading.Thread(target=lambda: (time.sleep(0.3), print("thread finished"))).start()
        atexit.register(lambda: print("atexit handler ran"))
        sys.stdout.write("unflushed line")
        exit_without_teardown(3)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 3, result.stderr
    assert result.stdout.splitlines() == ["unflushed linethread finished", "atexit handler ran"]
