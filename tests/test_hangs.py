"""Hung ranks: the heartbeat a rank writes (dstrain/rank/heartbeat.py), the stack it dumps on SIGUSR1,
the watchdog's verdict and report (dstrain/hangs.py, dstrain/launcher/watchdog.py); and at launcher
level, a user model that blocks forever on rank 1 (tests/user_code/usermods.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dstrain.hangs import (SLOW_FACTOR, Beat, collective_timeout_s, hang_timeout_s, judge, read_beats)
from dstrain.launcher.watchdog import dump_stacks, report
from dstrain.rank.heartbeat import WRITE_EVERY_S, Heartbeat
from launcher import dstrain

RANK_STUCK_IN_FORWARD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from dstrain.rank import heartbeat
    run_dir = Path(sys.argv[1])
    (run_dir / "ranks").mkdir(exist_ok=True)
    heartbeat.start(run_dir, 1)
    heartbeat.beat("data", 5)
    heartbeat.beat("forward")

    def wait_forever():
        print("blocking", flush=True)
        while True:
            time.sleep(3600)

    wait_forever()
""")


def beat(rank: int, phase: str, step: int | None, idle_s: float, first_step: int | None = 1,
         now: float = 1000.0) -> Beat:
    return Beat(rank, 100 + rank, "host", phase, step, first_step, now - idle_s)


@pytest.fixture
def stuck_rank(tmp_path):
    """A real process with a real heartbeat, blocked in wait_forever() during forward of step 5."""
    process = subprocess.Popen([sys.executable, "-c", RANK_STUCK_IN_FORWARD, str(tmp_path)],
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "blocking"
    yield tmp_path, process
    process.kill()
    process.wait()


def test_a_rank_reports_its_phase_step_and_pid_and_the_time_of_the_report(stuck_rank):
    run_dir, process = stuck_rank
    time.sleep(2 * WRITE_EVERY_S)  # the writer thread's turn
    report_ = read_beats(run_dir)[1]
    assert (report_.phase, report_.step, report_.pid, report_.first_step) == ("forward", 5, process.pid, 5)
    assert time.time() - report_.since < 30


def test_sigusr1_dumps_the_python_stack_of_a_blocked_rank(stuck_rank):
    run_dir, process = stuck_rank
    stacks = dump_stacks(run_dir, {1: process.pid})
    assert "in wait_forever" in stacks[1] and "(most recent call first)" in stacks[1]
    assert process.poll() is None  # the signal dumps, it does not kill


def test_a_report_costs_no_write_and_the_thread_writes_it_later(tmp_path):
    (tmp_path / "ranks").mkdir()
    heartbeat = Heartbeat(tmp_path, 0)
    heartbeat.beat("data", 3)
    assert not (tmp_path / "ranks" / "rank0.beat").exists()  # nothing on the loop's path
    heartbeat.thread.start()
    time.sleep(3 * WRITE_EVERY_S)
    heartbeat.stop.set()
    assert json.loads((tmp_path / "ranks" / "rank0.beat").read_text())["step"] == 3


def test_every_rank_silent_past_the_timeout_is_a_hang_naming_the_rank_furthest_behind():
    beats = {0: beat(0, "backward", 5, idle_s=20.5), 1: beat(1, "forward", 5, idle_s=21), 2: beat(2, "step", 5, 20.2)}
    verdict = judge(beats, 1000.0, timeout_s=20)
    assert verdict.stuck.rank == 1 and [b.rank for b in verdict.waiting] == [0, 2]
    assert verdict.idle_s == pytest.approx(21) and verdict.allowance_s == 20


def test_a_rank_in_an_earlier_phase_of_the_step_is_blamed_before_one_silent_longer():
    # rank 0 ran ahead into backward (an all-reduce waiting for rank 1) before rank 1 began its forward
    beats = {0: beat(0, "backward", 5, idle_s=22), 1: beat(1, "forward", 5, idle_s=21)}
    assert judge(beats, 1000.0, timeout_s=20).stuck.rank == 1


def test_a_rank_at_a_lower_step_is_blamed_before_one_silent_longer():
    beats = {0: beat(0, "log", 7, idle_s=40), 1: beat(1, "data", 6, idle_s=30)}
    assert judge(beats, 1000.0, timeout_s=20).stuck.rank == 1


def test_no_hang_while_any_rank_still_makes_progress():
    beats = {0: beat(0, "backward", 5, idle_s=25), 1: beat(1, "forward", 5, idle_s=5)}
    assert judge(beats, 1000.0, timeout_s=20) is None


@pytest.mark.parametrize("slow", [beat(0, "save", 8, idle_s=50), beat(0, "startup", None, idle_s=50),
                                  beat(0, "forward", 1, idle_s=50, first_step=1)])
def test_saves_startup_and_the_first_step_get_the_longer_allowance(slow):
    assert judge({0: slow}, 1000.0, timeout_s=20) is None
    assert judge({0: beat(0, "forward", 2, idle_s=50)}, 1000.0, timeout_s=20) is not None
    assert judge({0: slow}, 1000.0 + SLOW_FACTOR * 20, timeout_s=20) is not None


def test_finished_ranks_are_not_waited_for_and_zero_turns_detection_off():
    assert judge({0: beat(0, "done", 9, idle_s=500)}, 1000.0, timeout_s=20) is None
    assert judge({0: beat(0, "forward", 5, idle_s=500)}, 1000.0, timeout_s=0) is None


def test_auto_timeout_depends_on_the_accelerator_and_collectives_outlast_every_allowance():
    assert hang_timeout_s("auto", "cuda") == 600 and hang_timeout_s("auto", "cpu") > 600
    assert hang_timeout_s(45, "cuda") == 45
    assert collective_timeout_s(600) > SLOW_FACTOR * 600
    assert collective_timeout_s(0) is None


def test_the_report_names_rank_phase_step_waiting_ranks_stack_and_latest(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step00000004")
    verdict = judge({0: beat(0, "backward", 5, 21, now=time.time()), 1: beat(1, "forward", 5, 22, now=time.time())},
                    time.time(), timeout_s=20)
    text = "\n".join(report(verdict, 'Thread 0x1 (most recent call first):\n  File "m.py", line 3 in wait_forever',
                            tmp_path))
    assert "rank 1 made no progress for 22 s (limit 20 s, train.hang_timeout_s) in phase forward of step 5" in text
    assert "rank 0: in phase backward of step 5" in text and "in wait_forever" in text
    assert "the last complete checkpoint step00000004 stays `latest`" in text


# ---------------------------------------------------------------------------------------
# Launcher level: a user model that blocks forever on rank 1 at step 5

USER_CODE = Path(__file__).parent / "user_code"
HANG_TIMEOUT_S = 20


@pytest.fixture(scope="module")
def hung_job(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("hang") / "run"
    args = ["run", "--preset", "stage2", "--accelerator", "cpu", "--gpus", "2", "--run-dir", str(run_dir)]
    for item in ("model.name=usermods:hangs_on_rank1", "data.source=usermods:pairs", "data.kwargs={size: 512}",
                 "data.seq_len=1", "train.micro_batch_size=8", "train.eval_batches=2", "train.max_steps=100",
                 "train.log_every=1", "train.save_every=2", "train.eval_every=1000",
                 f"train.hang_timeout_s={HANG_TIMEOUT_S}"):
        args += ["--set", item]
    done = dstrain(*args, cwd=USER_CODE, timeout=600, env={"COLUMNS": "250"})  # in this process: no fresh interpreter
    ended_at = time.time()
    blocked_at = read_beats(run_dir)[1].since  # rank 1's last report: the forward it never left
    return run_dir, done, ended_at - blocked_at


@pytest.mark.integration
def test_a_rank_blocked_in_user_code_ends_the_job_naming_rank_phase_and_stack(hung_job):
    run_dir, done, after_s = hung_job
    output = " ".join(done.stdout.split())
    assert done.returncode == 1, done.stdout + done.stderr
    assert "hang: rank 1 made no progress for" in output, output
    assert f"(limit {HANG_TIMEOUT_S} s, train.hang_timeout_s) in phase forward of step 5" in output, output
    assert "rank 0: in phase" in output and "of step 5" in output, output  # held in a collective by rank 1
    assert "in wait_forever" in output and "usermods.py" in output, output  # rank 1's own Python stack
    assert "training failed" not in output
    assert HANG_TIMEOUT_S < after_s < HANG_TIMEOUT_S + 20


@pytest.mark.integration
def test_a_hung_job_leaves_latest_on_its_last_complete_checkpoint_and_no_rank_running(hung_job):
    run_dir, done, _ = hung_job
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step00000004"
    assert (run_dir / "checkpoints" / "step00000004" / "dstrain_complete.json").is_file()
    assert "the last complete checkpoint step00000004 stays `latest`" in " ".join(done.stdout.split())
    assert not [p for p in Path("/proc").iterdir() if p.name.isdigit() and _is_rank_of(p, run_dir)]


def _is_rank_of(proc: Path, run_dir: Path) -> bool:
    try:
        cmdline = (proc / "cmdline").read_bytes()
    except OSError:
        return False
    return b"dstrain.rank.worker" in cmdline and str(run_dir.resolve()).encode() in cmdline
