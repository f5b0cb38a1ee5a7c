"""The nodes of a multi-node job, judged in-process (dstrain/launcher/nodes.py): whom the job waits for
while it assembles, when a node that never came ends it, and when a node that gives no sign of life
does, told apart from a rank that is alive but slow by its heartbeat thread's own beat
(dstrain/rank/heartbeat.py). The launcher runs of the same cases are in tests/test_multinode.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from rich.console import Console
from typer.testing import CliRunner

from dstrain.cli import app
from dstrain.hangs import DONE, Beat, read_beats
from dstrain.launcher.failures import failure_report, record_deaths, wait_for_records
from dstrain.launcher.nodes import (FAILED_GRACE_S, FIRST_NOTE_S, NOTE_EVERY_S, VERDICT, Node, NodeSupervision,
                                    NodeWatch, node_layout, record_verdict)

TWO_NODES = node_layout({"node0": 1, "node1": 1})


def beat(rank: int, alive: float, phase: str = "forward", step: int | None = 7, since: float = 0.0) -> Beat:
    return Beat(rank, 100 + rank, "elsewhere", phase, step, 1, since, alive)


def write_beat(run_dir, b: Beat) -> None:
    (run_dir / "ranks").mkdir(exist_ok=True)
    (run_dir / "ranks" / f"rank{b.rank}.beat").write_text(b.to_json())


def plain(lines: list[str]) -> str:
    console = Console(width=400, highlight=False, record=True, file=open(os.devnull, "w"))
    for line in lines:
        console.print(line)
    return console.export_text()


def test_ranks_are_numbered_node_by_node_as_deepspeed_numbers_them():
    nodes = node_layout({"worker-0": 8, "worker-1": 4, "worker-2": 8})
    assert [(n.index, n.host, list(n.ranks)) for n in nodes] == [
        (0, "worker-0", list(range(8))), (1, "worker-1", list(range(8, 12))), (2, "worker-2", list(range(12, 20)))]
    assert nodes[1].name() == "node 1 (worker-1)"
    assert TWO_NODES[1].name() == "node 1"  # --no-ssh's stand-in host name is not repeated


# ---------------------------------------------------------------------------------------
# A node that never joins

def test_a_node_waited_for_is_named_after_5_s_then_every_30_s_and_ends_the_job_at_the_join_timeout(tmp_path):
    watch = NodeWatch(tmp_path, TWO_NODES, join_timeout_s=100, liveness_timeout_s=60, now=0.0, before={})
    timeline = {}
    for now in range(0, 101):
        notes, verdict = watch.check({0: beat(0, alive=float(now))}, float(now))
        if notes:
            timeline[now] = notes[0]
        if verdict:
            break
    assert sorted(timeline) == [FIRST_NOTE_S + k * NOTE_EVERY_S for k in range(4)]  # 5, 35, 65, 95
    assert timeline[5].startswith("waiting 5 s for node 1 to join (rank 1 not started yet); the job ends if they "
                                  "have not joined 100 s after")
    assert now == 100 and verdict.kind == "missing" and verdict.ranks == [1] and verdict.nodes == [TWO_NODES[1]]
    text = plain(verdict.lines)
    assert "node 1 never joined: rank 1 had not started after 100 s (train.join_timeout_s, --join-timeout)" in text
    assert "output of its `dstrain run`" in text and str(tmp_path / "ranks") in text
    assert "ending the job on every node; no checkpoint was saved" in text


def test_an_earlier_jobs_record_is_no_sign_that_a_node_joined(tmp_path):
    """A run directory resumed after a failure still holds the lost node's last record: until it changes,
    that node has not joined this job."""
    old = beat(1, alive=500.0, phase="forward")
    watch = NodeWatch(tmp_path, TWO_NODES, join_timeout_s=30, liveness_timeout_s=60, now=0.0, before={1: old})
    _, verdict = watch.check({0: beat(0, 10.0), 1: old}, 31.0)
    assert verdict is not None and verdict.ranks == [1]
    watch = NodeWatch(tmp_path, TWO_NODES, join_timeout_s=30, liveness_timeout_s=60, now=0.0, before={1: old})
    watch.check({0: beat(0, 10.0), 1: old}, 1.0)
    notes, verdict = watch.check({0: beat(0, 12.0), 1: beat(1, alive=501.0)}, 2.0)  # it writes again: joined
    assert verdict is None


def test_nodes_that_join_late_are_greeted_once_and_a_join_timeout_of_0_waits_as_long_as_it_takes(tmp_path):
    watch = NodeWatch(tmp_path, TWO_NODES, join_timeout_s=0, liveness_timeout_s=60, now=0.0, before={})
    notes, verdict = watch.check({0: beat(0, 1.0)}, 5000.0)
    assert verdict is None and "no limit: train.join_timeout_s is 0" in notes[0]
    notes, verdict = watch.check({0: beat(0, 2.0), 1: beat(1, 2.0)}, 5001.0)
    assert notes == ["all 2 nodes have joined after 5001 s"] and verdict is None
    assert watch.check({0: beat(0, 3.0), 1: beat(1, 3.0)}, 5002.0) == ([], None)


def test_a_node_waits_aloud_for_the_others_not_for_its_own_ranks_still_starting(tmp_path):
    watch = NodeWatch(tmp_path, TWO_NODES, join_timeout_s=100, liveness_timeout_s=60, now=0.0, before={},
                      own_ranks=range(1, 2))
    notes, _ = watch.check({}, 5.0)
    assert notes[0].startswith("waiting 5 s for node 0 to join (rank 0 not started yet)")
    notes, _ = watch.check({0: beat(0, 6.0)}, 36.0)
    assert notes == []  # its own rank 1 is late, but that is no one else's to start
    _, verdict = watch.check({0: beat(0, 100.0)}, 100.0)
    assert verdict.ranks == [1]  # ... and the join timeout holds for it too


def test_a_rank_that_started_but_wrote_no_heartbeat_is_named_with_its_log(tmp_path):
    (tmp_path / "ranks").mkdir()
    (tmp_path / "ranks" / "rank1.log").write_text("Traceback ...")
    watch = NodeWatch(tmp_path, TWO_NODES, join_timeout_s=10, liveness_timeout_s=60, now=0.0, before={})
    _, verdict = watch.check({0: beat(0, 1.0)}, 10.0)
    assert f"rank 1 started, but wrote no heartbeat; its log: {tmp_path / 'ranks' / 'rank1.log'}" in plain(verdict.lines)


# ---------------------------------------------------------------------------------------
# A node that stops answering

def watch_until(watch: NodeWatch, end: float, frozen: dict[int, Beat], start: float = 2.0):
    """Check every second from `start` to `end`: node 0 beats on, the ranks in `frozen` do not.
    Returns the first verdict (or None) and the time it came."""
    now = start
    while now <= end:
        _, verdict = watch.check({0: beat(0, now), **frozen}, now)
        if verdict is not None:
            return verdict, now
        now += 1.0
    return None, now


def joined(run_dir, liveness_timeout_s: float = 60) -> NodeWatch:
    watch = NodeWatch(run_dir, TWO_NODES, join_timeout_s=300, liveness_timeout_s=liveness_timeout_s, now=0.0,
                      before={})
    assert watch.check({0: beat(0, 1.0), 1: beat(1, 1.0)}, 1.0) == ([], None)
    return watch


def test_a_rank_whose_beat_stops_ends_the_job_after_the_liveness_timeout_naming_its_last_sign_of_life(tmp_path):
    watch = joined(tmp_path)
    verdict, when = watch_until(watch, 200.0, {1: beat(1, alive=1.0, phase="backward", step=40)})
    assert when == 62.0 and verdict.kind == "lost" and verdict.ranks == [1] and verdict.nodes == [TWO_NODES[1]]
    text = plain(verdict.lines)
    assert "node 1 stopped answering: no sign of life from rank 1 for 61 s (limit 60 s, train.liveness_timeout_s)" in text
    assert (f"rank 1 (pid 101 on elsewhere): last sign of life at {time.strftime('%H:%M:%S', time.localtime(1.0))} "
            f"(that host's clock), in phase backward of step 40; its log: {tmp_path / 'ranks' / 'rank1.log'}") in text


def test_a_rank_alive_but_slow_is_no_verdict_however_long_its_step(tmp_path):
    """A compile of ten minutes: no progress (`since` stays), but the beat's thread writes on."""
    watch = joined(tmp_path)
    for now in range(2, 2000, 2):
        slow = beat(1, alive=float(now), phase="forward", step=1, since=0.0)
        assert watch.check({0: beat(0, float(now)), 1: slow}, float(now)) == ([], None)


def test_a_rank_that_finished_is_not_waited_for(tmp_path):
    watch = joined(tmp_path)
    done = beat(1, alive=1.0, phase=DONE)
    assert watch.check({0: beat(0, 500.0), 1: done}, 500.0) == ([], None)


def test_a_supervisor_that_did_not_look_for_a_while_does_not_blame_the_ranks(tmp_path):
    """`dstrain run` itself suspended (Ctrl-Z, a laptop's sleep): the silence it would measure is its own."""
    watch = joined(tmp_path)
    assert watch.check({0: beat(0, 1.0), 1: beat(1, 1.0)}, 500.0) == ([], None)
    verdict, when = watch_until(watch, 600.0, {1: beat(1, 1.0)}, start=501.0)
    assert verdict.ranks == [1] and when == 561.0  # 61 s of its own watching


def test_liveness_timeout_0_turns_the_watch_off(tmp_path):
    watch = joined(tmp_path, liveness_timeout_s=0)
    assert watch.check({0: beat(0, 1.0), 1: beat(1, 1.0)}, 10_000.0) == ([], None)


RANK_THAT_COMPILES = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from dstrain.rank import heartbeat
    heartbeat.ALIVE_EVERY_S = 0.2
    run_dir = Path(sys.argv[1])
    (run_dir / "ranks").mkdir(exist_ok=True)
    heartbeat.start(run_dir, 1)
    heartbeat.beat("forward", 1)
    print("compiling", flush=True)
    x = 0
    while True:  # pure Python holding the GIL between switches, like a compiler's passes
        x = (x * 31 + 7) % 1000003
""")


def test_a_real_rank_busy_in_python_shows_life_and_once_stopped_shows_none(tmp_path):
    process = subprocess.Popen([sys.executable, "-c", RANK_THAT_COMPILES, str(tmp_path)], stdout=subprocess.PIPE,
                               text=True)
    try:
        assert process.stdout.readline().strip() == "compiling"
        time.sleep(0.5)
        first = read_beats(tmp_path)[1]
        time.sleep(1.0)
        busy = read_beats(tmp_path)[1]
        assert busy.alive > first.alive and busy.since == first.since  # alive, and no progress
        os.kill(process.pid, signal.SIGSTOP)
        time.sleep(0.5)
        stopped = read_beats(tmp_path)[1]
        time.sleep(1.0)
        assert read_beats(tmp_path)[1].alive == stopped.alive
        watch = NodeWatch(tmp_path, [Node(0, "here", range(0, 1)), Node(1, "here", range(1, 2))], 300, 10, now=0.0,
                          before={})
        watch.check({0: beat(0, 1.0), 1: stopped}, 1.0)
        verdict, when = watch_until(watch, 20.0, {1: read_beats(tmp_path)[1]})
        assert verdict.ranks == [1] and when == 12.0
        assert "its process is stopped (SIGSTOP?)" in plain(verdict.lines)
    finally:
        process.kill()
        process.wait()


# ---------------------------------------------------------------------------------------
# A node whose rank dies while the others wait in a collective (NCCL: they do not fail on their own)

def started(run_dir, *ranks: int) -> None:
    (run_dir / "ranks").mkdir(exist_ok=True)
    for rank in ranks:
        (run_dir / "ranks" / f"rank{rank}.pid").write_text(str(10 ** 6 + rank))  # no such process


def test_a_node_records_its_rank_that_died_and_judges_no_rank_of_another_node_without_a_record(tmp_path):
    started(tmp_path, 0, 1)
    # Node 1 after its launcher gave up: rank 1 died; rank 0 is node 0's, still running there (no record).
    assert record_deaths(tmp_path, alive=set(), own_ranks=range(1, 2)) == [1]
    assert not (tmp_path / "ranks" / "rank0.exit").exists()
    assert failure_report(tmp_path, set(), own_ranks=range(1, 2)) == [
        f"rank 1 died without reporting (killed by a signal such as SIGKILL, or out of memory); its log: "
        f"{tmp_path / 'ranks' / 'rank1.log'}"]
    # Node 0, whose own rank failed on the broken collective (gloo): rank 1's death is named from node 1's record.
    (tmp_path / "ranks" / "rank0.exit").write_text("failed: RuntimeError: Connection closed by peer")
    assert record_deaths(tmp_path, alive=set(), own_ranks=range(0, 1)) == []  # rank 0 wrote its own
    assert failure_report(tmp_path, set(), own_ranks=range(0, 1))[0].startswith("rank 1 died without reporting")


def test_a_node_waits_a_moment_for_the_other_nodes_records_but_not_for_ranks_still_running(tmp_path):
    started(tmp_path, 0, 1)
    begun = time.monotonic()
    wait_for_records(tmp_path, own_ranks=range(0, 1), timeout_s=0.5)  # rank 1 never records: the whole wait
    assert time.monotonic() - begun >= 0.5
    (tmp_path / "ranks" / "rank1.exit").write_text("died: killed")
    begun = time.monotonic()
    wait_for_records(tmp_path, own_ranks=range(0, 1), timeout_s=5)
    assert time.monotonic() - begun < 0.5


def test_another_nodes_dead_rank_ends_the_job_a_grace_period_after_its_record_naming_it(tmp_path):
    started(tmp_path, 0, 1)
    (tmp_path / "ranks" / "rank1.exit").write_text("died: an earlier job's")
    supervision = NodeSupervision(tmp_path, TWO_NODES, 300, 60, Console(file=open(os.devnull, "w")),
                                  own_ranks=range(0, 1))
    assert supervision.failures() == {}  # an earlier job's record is not this job's
    (tmp_path / "ranks" / "rank1.exit").unlink()  # node 1 starts: its records are replaced
    (tmp_path / "ranks" / "rank0.exit").write_text("failed: this node's own rank: its launcher reports it")
    time.sleep(0.01)
    record_deaths(tmp_path, alive=set(), own_ranks=range(1, 2))  # node 1, after its rank was killed
    failures = supervision.failures()
    assert set(failures) == {0, 1} and failures[1].startswith("died: ")

    watch = NodeWatch(tmp_path, TWO_NODES, join_timeout_s=300, liveness_timeout_s=60, now=0.0, before={},
                      own_ranks=range(0, 1))
    beats = {0: beat(0, 1.0), 1: beat(1, 1.0)}
    assert watch.check(beats, 1.0) == ([], None)
    assert watch.check(beats, 2.0, failures) == ([], None)  # node 0's ranks may still end on their own (gloo)
    _, verdict = watch.check(beats, 2.0 + FAILED_GRACE_S, failures)
    assert verdict.kind == "failed" and verdict.ranks == [1] and verdict.nodes == [TWO_NODES[1]]
    text = plain(verdict.lines)
    assert "node 1 failed: this node's ranks were waiting for rank 1 in a collective" in text
    assert (f"rank 1 died without reporting (killed by a signal such as SIGKILL, or out of memory); its log: "
            f"{tmp_path / 'ranks' / 'rank1.log'}") in text
    assert record_verdict(tmp_path, verdict, before=None)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["event"], r["ranks"]) for r in rows] == [("node_failed", [1])]
    assert (tmp_path / "ranks" / "rank1.exit").read_text().startswith("died: ")  # its node's record stays


def test_another_nodes_rank_that_raised_ends_the_job_too_and_a_finished_or_lost_rank_does_not(tmp_path):
    watch = NodeWatch(tmp_path, TWO_NODES, join_timeout_s=300, liveness_timeout_s=60, now=0.0, before={},
                      own_ranks=range(0, 1))
    beats = {0: beat(0, 1.0), 1: beat(1, 1.0)}
    failure = {1: "error: data.paths: /data/x.jsonl does not exist\n  fix: ..."}
    watch.check(beats, 1.0, failure)
    _, verdict = watch.check(beats, 1.0 + FAILED_GRACE_S, failure)
    assert "rank 1 failed: data.paths: /data/x.jsonl does not exist" in plain(verdict.lines)
    (tmp_path / "ranks").mkdir(exist_ok=True)
    supervision = NodeSupervision(tmp_path, TWO_NODES, 300, 60, Console(file=open(os.devnull, "w")),
                                  own_ranks=range(0, 1))
    (tmp_path / "ranks" / "rank1.exit").write_text("ok")
    (tmp_path / "ranks" / "rank2.exit").write_text("lost: node 2 stopped answering")
    assert supervision.failures() == {}


# ---------------------------------------------------------------------------------------
# The verdict in the run directory

def test_the_first_node_records_the_verdict_and_the_others_read_it(tmp_path):
    (tmp_path / "ranks").mkdir()
    (tmp_path / "ranks" / "rank0.exit").write_text("ok")
    write_beat(tmp_path, beat(0, 1.0, step=41))
    write_beat(tmp_path, beat(1, 1.0, step=40))
    other = NodeSupervision(tmp_path, TWO_NODES, 300, 60, Console(file=open(os.devnull, "w")))
    watch = joined(tmp_path)
    verdict, _ = watch_until(watch, 99.0, {1: beat(1, 1.0, phase="backward", step=40)})
    assert record_verdict(tmp_path, verdict, before=None)
    assert not record_verdict(tmp_path, verdict, before=None)  # the second node to decide writes nothing
    report = (tmp_path / "ranks" / VERDICT).read_text()
    assert report.startswith("node 1 stopped answering: no sign of life from rank 1 for 61 s") and "[" not in report
    assert (tmp_path / "ranks" / "rank1.exit").read_text() == "lost: " + report.splitlines()[0]
    assert (tmp_path / "ranks" / "rank0.exit").read_text() == "ok"  # a rank's own record stays
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["event"], r["step"], r["nodes"], r["ranks"]) for r in rows] == [("node_lost", 41, [1], [1])]
    assert other.verdict_elsewhere() == report.splitlines()


def test_an_earlier_jobs_verdict_is_replaced_and_not_read_as_this_jobs(tmp_path):
    (tmp_path / "ranks").mkdir()
    (tmp_path / "ranks" / VERDICT).write_text("node 3 never joined: an earlier job\n")
    supervision = NodeSupervision(tmp_path, TWO_NODES, 300, 60, Console(file=open(os.devnull, "w")))
    assert supervision.verdict_elsewhere() == []
    watch = NodeWatch(tmp_path, TWO_NODES, join_timeout_s=1, liveness_timeout_s=60, now=0.0, before={})
    _, verdict = watch.check({}, 2.0)
    assert record_verdict(tmp_path, verdict, supervision.verdict_before)
    assert (tmp_path / "ranks" / VERDICT).read_text().startswith("node 0, node 1 never joined: ranks 0, 1")


# ---------------------------------------------------------------------------------------
# The settings

@pytest.mark.parametrize("args, says", [
    (["--join-timeout", "-1"], "--join-timeout"),
    (["--set", "train.liveness_timeout_s=5"], "train.liveness_timeout_s"),
])
def test_impossible_timeouts_exit_2_naming_the_setting(args, says):
    result = CliRunner().invoke(app, ["run", "--dry-run", "--accelerator", "cpu", "--set", "model.n_layer=1", *args],
                                env={"COLUMNS": "250"})
    assert result.exit_code == 2 and says in result.output, result.output


def test_the_defaults_suit_users_not_tests():
    """Tests pass small timeouts (--join-timeout, --set train.liveness_timeout_s); a user gets minutes to start
    the nodes and a minute of silence before a node counts as lost (docs/multi-node.md)."""
    from dstrain.config.resolve import resolve
    train = resolve(None, None, []).config.train
    assert (train.join_timeout_s, train.liveness_timeout_s) == (300, 60)
