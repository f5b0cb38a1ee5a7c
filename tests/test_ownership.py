"""One job per run directory (dstrain/launcher/ownership.py): a real flock held by another process
refuses a second writer naming the holder; a dead holder's lock is taken over with a note; the nodes
of one --no-ssh job share it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dstrain.cli import app
from dstrain.errors import UserError
from dstrain.launcher.ownership import acquire
from dstrain.launcher.run_directory import prepare_run_dir
from launcher import TINY, dstrain

HOLD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from dstrain.launcher.ownership import acquire
    lock = acquire(Path(sys.argv[1]), "--run-dir", sys.argv[2] or None)
    print("held", flush=True)
    sys.stdin.readline()  # hold until told, or until killed
    if sys.argv[3] == "release":
        lock.release()
""")


def holder(run_dir: Path, job: str = "", end: str = "release") -> subprocess.Popen:
    """Another process that takes the lock and holds it until its stdin gets a line."""
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir), job, end], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "held"
    return process


def test_a_second_writer_is_refused_naming_the_holders_pid_host_and_command(tmp_path):
    process = holder(tmp_path)
    try:
        with pytest.raises(UserError) as refused:
            acquire(tmp_path, f"--run-dir {tmp_path}")
    finally:
        process.communicate("\n", timeout=30)
    message = str(refused.value)
    assert f"--run-dir {tmp_path}: this run directory belongs to a job that is still running" in message
    assert f"pid {process.pid} on host {socket.gethostname()}" in message
    assert "dstrain " in message and "choose another --run-dir" in message


def test_a_lock_released_cleanly_is_taken_without_a_note(tmp_path):
    holder(tmp_path).communicate("\n", timeout=30)
    lock = acquire(tmp_path, "--run-dir")
    assert lock.handle is not None and lock.note is None
    lock.release()


def test_the_lock_of_a_killed_holder_is_taken_over_with_a_note_naming_it(tmp_path):
    process = holder(tmp_path, end="stay")
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    lock = acquire(tmp_path, "--run-dir")
    try:
        assert lock.handle is not None
        assert lock.note.startswith("took over the run directory from a job that is gone")
        assert f"pid {process.pid} on host {socket.gethostname()}" in lock.note
        details = json.loads((tmp_path / "run.lock").read_text())
        assert details["pid"] == os.getpid()  # the stale content is replaced by ours
    finally:
        lock.release()


def test_a_node_of_the_same_multi_node_job_joins_instead_of_being_refused(tmp_path):
    process = holder(tmp_path, job="10.0.0.1:29500/2 nodes")
    try:
        joined = acquire(tmp_path, "--run-dir", job="10.0.0.1:29500/2 nodes")
        assert joined.handle is None and f"pid {process.pid}" in joined.note
        with pytest.raises(UserError, match="still running"):
            acquire(tmp_path, "--run-dir", job="10.0.0.2:29500/2 nodes")  # another job
    finally:
        process.communicate("\n", timeout=30)


def test_a_refused_run_writes_nothing_in_the_directory(tmp_path):
    (tmp_path / "config.yaml").write_text("A's config")
    process = holder(tmp_path)
    try:
        with pytest.raises(UserError):
            prepare_run_dir(tmp_path, resuming=True)
    finally:
        process.communicate("\n", timeout=30)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "run.lock"]
    assert (tmp_path / "config.yaml").read_text() == "A's config"


# ---------------------------------------------------------------------------------------
# Launcher level: job B started into job A's live run directory

def metric_steps(run_dir: Path) -> list[int]:
    try:
        return [row["step"] for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
                if "loss" in row]
    except (OSError, ValueError):
        return []


def wait_for(condition, job: subprocess.Popen, log: Path, what: str, timeout: float = 300) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert job.poll() is None, f"job A ended (exit {job.returncode}) before {what}:\n{log.read_text()}"
        assert time.monotonic() < end, f"no {what} within {timeout} s:\n{log.read_text()}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def two_jobs(tmp_path_factory):
    """D holds the lock of a job that was killed; job A takes D over and trains into it; job B (other
    settings) is started into D; then A gets Ctrl-C (SIGINT)."""
    base = tmp_path_factory.mktemp("owned")
    run_dir, log = base / "D", base / "a.log"
    run_dir.mkdir()
    stale = holder(run_dir, end="stay")
    stale.kill()
    stale.wait(timeout=30)
    args = ["run", "--preset", "stage2", "--accelerator", "cpu", "--gpus", "2", "--run-dir", str(run_dir)]
    sets = [a for s in (*TINY, "train.eval_every=100000", "train.log_every=1", "train.save_every=100000")
            for a in ("--set", s)]
    with open(log, "w") as out:
        job_a = subprocess.Popen([sys.executable, "-m", "dstrain.cli", *args, *sets, "--set", "train.max_steps=100000"],
                                 stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "COLUMNS": "250"})
    try:
        wait_for(lambda: len(metric_steps(run_dir)) >= 2, job_a, log, "two training steps")
        config_before = (run_dir / "config.yaml").read_text()
        # B in this process (no fresh interpreter): refused sooner, so A trains fewer steps while it waits
        job_b = dstrain(*args, *sets, "--set", "train.max_steps=10", timeout=300, env={"COLUMNS": "250"})
        steps_at_b = metric_steps(run_dir)[-1]
        wait_for(lambda: metric_steps(run_dir)[-1] >= steps_at_b + 2, job_a, log, "two more steps after B")
        config_after = (run_dir / "config.yaml").read_text()
        job_a.send_signal(signal.SIGINT)
        job_a.wait(timeout=150)
    finally:
        if job_a.poll() is None:
            job_a.kill()
    return run_dir, job_a, " ".join(log.read_text().split()), job_b, config_before, config_after, stale.pid


@pytest.mark.integration
def test_a_second_job_into_a_live_run_directory_exits_2_naming_the_first(two_jobs):
    run_dir, job_a, _, job_b, _, _, _ = two_jobs
    message = " ".join(job_b.stderr.split())
    assert job_b.returncode == 2, job_b.stdout + job_b.stderr
    assert "this run directory belongs to a job that is still running" in message
    assert f"pid {job_a.pid} on host {socket.gethostname()}" in message
    assert "Traceback" not in message and "run directory:" not in job_b.stdout  # refused before starting


@pytest.mark.integration
def test_dstrain_run_takes_over_the_lock_of_a_killed_job_with_a_note(two_jobs):
    _, _, output_a, _, _, _, stale_pid = two_jobs
    assert f"took over the run directory from a job that is gone (pid {stale_pid} on host " \
           f"{socket.gethostname()}" in output_a


@pytest.mark.integration
def test_the_first_job_is_unharmed_by_the_refused_one(two_jobs):
    run_dir, _, output_a, _, config_before, config_after, _ = two_jobs
    assert config_after == config_before and "max_steps: 100000" in config_after
    steps = metric_steps(run_dir)
    assert steps == list(range(1, len(steps) + 1))  # one job's metrics, no second series mixed in
    assert "step00000010" not in output_a and not (run_dir / "checkpoints" / "step00000010").exists()


@pytest.mark.integration
def test_ctrl_c_saves_stops_and_every_message_names_sigint(two_jobs):
    run_dir, job_a, output_a, _, _, _, _ = two_jobs
    step = metric_steps(run_dir)[-1]
    assert job_a.returncode == 130, output_a
    assert "SIGINT: asking the ranks to save a checkpoint and stop" in output_a
    assert f"stopped by SIGINT at step {step}; checkpoint saved" in output_a
    assert "SIGTERM" not in output_a
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step{step:08d}"
    assert (run_dir / "run.lock").read_text() == ""  # released: the next job takes it without a note


def test_ranks_left_running_by_a_killed_dstrain_run_keep_the_directory_taken(tmp_path):
    # A process with a rank's command line and pid record: what a SIGKILLed `dstrain run` leaves behind.
    orphan = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(120)",
                               "dstrain.rank.worker", str(tmp_path.resolve())], stdout=subprocess.PIPE, text=True)
    assert orphan.stdout.readline().strip() == "up"
    try:
        (tmp_path / "ranks").mkdir()
        (tmp_path / "ranks" / "rank0.pid").write_text(str(orphan.pid))
        with pytest.raises(UserError, match=f"ranks of an earlier job still run in this run directory "
                                             f"\\(pids {orphan.pid}\\)"):
            acquire(tmp_path, "--run-dir")
    finally:
        orphan.kill()
        orphan.wait()
    acquire(tmp_path, "--run-dir").release()  # free once they are gone


def test_a_dry_run_into_a_live_run_directory_warns_and_creates_nothing(tmp_path):
    process = holder(tmp_path)
    try:
        done = CliRunner().invoke(app, ["run", "--dry-run", "--accelerator", "cpu", "--gpus", "2", "--run-dir",
                                        str(tmp_path), *[a for s in TINY for a in ("--set", s)]],
                                  env={"COLUMNS": "250"})
    finally:
        process.communicate("\n", timeout=30)
    assert done.exit_code == 0, done.output
    assert f"the run directory belongs to a running job (pid {process.pid} on host" in done.output
    assert "this run would be refused" in done.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.lock"]


def test_the_holders_command_in_the_lock_file_has_no_secret(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/venv/bin/dstrain", "run", "--set", "deepspeed.comet.api_key=s3cr3t",
                                      "--set", "train.lr=0.01"])
    lock = acquire(tmp_path, "--run-dir")
    try:
        command = json.loads((tmp_path / "run.lock").read_text())["command"]
    finally:
        lock.release()
    assert "s3cr3t" not in command
    assert command == "dstrain run --set 'deepspeed.comet.api_key=<redacted>' --set train.lr=0.01"
