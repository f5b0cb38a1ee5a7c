"""A failed run reads as one message (issue 38): the rank that failed first, its exception in a line,
the path of its full log under the run directory, and no traceback on the console; the known
third-party lines go to the rank logs. One real launcher run: 2 CPU ranks, a user model that raises
on rank 1 at its second forward."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dstrain.launcher.failures import failure_report
from dstrain.rundir import RANKS
from launcher import TINY, dstrain

TESTS = Path(__file__).parent


def _records(run_dir: Path, exits: dict[int, str]) -> None:
    """Exit records as ranks leave them (dstrain/rank/worker.py), written in rank order a few ms apart."""
    ranks = run_dir / RANKS
    ranks.mkdir(parents=True)
    for at, (rank, text) in enumerate(exits.items()):
        (ranks / f"rank{rank}.pid").write_text(str(1000 + rank))
        (ranks / f"rank{rank}.exit").write_text(text)
        os.utime(ranks / f"rank{rank}.exit", ns=(10**18 + at * 10**6, 10**18 + at * 10**6))


def test_a_failure_dstrain_can_trace_to_a_key_names_the_key_and_its_fix(tmp_path):
    _records(tmp_path, {1: "failed: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 "
                           "has a total capacity of 79.19 GiB of which 1.2 GiB is free.", 0: "ok"})
    lines = failure_report(tmp_path, alive=set())
    assert lines[0].startswith("rank 1 failed first: torch.OutOfMemoryError: CUDA out of memory.")
    assert lines[1].startswith("  config key: train.micro_batch_size (fix: lower it")
    assert lines[2] == f"  full log: {tmp_path / RANKS / 'rank1.log'}"
    assert len(lines) == 3


def test_the_first_rank_to_fail_is_named_and_the_others_follow_in_one_line(tmp_path):
    _records(tmp_path, {0: "failed: ValueError: Type fp16 is not supported on your device.",
                        1: "failed: RuntimeError: Connection closed by peer", 2: "failed: RuntimeError: closed"})
    lines = failure_report(tmp_path, alive=set())
    assert lines[0] == "rank 0 failed first: ValueError: Type fp16 is not supported on your device."
    assert lines[1].startswith("  config key: train.precision")
    assert lines[-1] == "  then ranks 1, 2 failed too (their logs are beside it)"


@pytest.mark.integration
def test_a_failed_run_is_one_message_naming_the_first_rank_and_its_log(tmp_path):
    run_dir = tmp_path / "run"
    sets = [*TINY, "model.name=failing_model:build",
            "model.kwargs={vocab_size: 256, seq_len: 32, d_model: 32, n_layer: 2, n_head: 2}",
            "train.max_steps=5", "train.log_every=1", "train.save_checkpoints=false", "train.precision=fp32"]
    args = ["run", "--preset", "stage2", "--accelerator", "cpu", "--gpus", "2", "--run-dir", str(run_dir)]
    for item in sets:
        args += ["--set", item]
    env = {"PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]), "COLUMNS": "200"}
    result = dstrain(*args, env=env, timeout=600)
    console = result.stdout + result.stderr
    assert result.returncode != 0, console
    assert "Traceback" not in console  # the traceback is in the rank's log, not here
    log = run_dir / "ranks" / "rank1.log"
    assert "rank 1 failed first: ValueError: shapes (4, 32) and (16, 32) do not align" in console, console
    assert f"full log: {log}" in console
    assert "Traceback" in log.read_text() and "failing_model.py" in log.read_text()
    assert console.count("do not align") == 1  # one message, not one per rank and one per launcher line
    assert "exits with return code" not in console
    # DeepSpeed's scheduler warning (every run prints it at its first step) went to the logs, not the console
    assert "Attempting to get learning rate from scheduler" not in console
    logs = "".join(p.read_text() for p in (run_dir / "ranks").glob("rank*.log"))
    assert "Attempting to get learning rate from scheduler" in logs
    assert "shm_comm_op built successfully" not in logs  # the ranks skipped that op (dstrain/rank/runtime.py)
    print(console)  # for the record: what a user sees


@pytest.mark.parametrize("width", [80, 200])
def test_the_live_progress_bar_fits_the_terminal_keeping_loss_and_throughput(tmp_path, width):
    import io

    import torch
    from rich.console import Console

    from dstrain.rank.metrics import MetricsLog
    metrics = MetricsLog(tmp_path, True, max_steps=100000, tokens_per_step=1024, flops_per_token=6e6, world=2,
                         device=torch.device("cpu"))
    metrics.console = Console(file=io.StringIO(), force_terminal=True, width=width, record=True, highlight=False)
    metrics.start(0)
    metrics.log_step(12345, 5.4321, 3e-4, elapsed=0.5, steps=5, stats={"grad_norm": 1.25})
    metrics.close()
    bar = "train " + metrics.console.export_text().split("train ")[-1].splitlines()[0]  # the last frame
    assert len(bar) <= width and "…" not in bar, bar
    assert "loss 5.4321" in bar and "tok/s" in bar and "12345/100000" in bar and "eta" in bar
    assert ("gnorm 1.25" in bar) == (width > 80)  # the least needed fields go first


def test_known_third_party_lines_go_to_the_rank_log_and_everything_else_to_both(tmp_path, monkeypatch):
    """The rank's streams (dstrain/rank/output.py), as installed in a rank: stderr is copied to the log;
    the known noise (print()ed in two writes, or logged in one) stays off the console unless --verbose."""
    import io
    import sys
    import warnings

    from dstrain.rank import output
    console_out, console_err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", console_out)
    monkeypatch.setattr(sys, "stderr", console_err)
    monkeypatch.setattr(output, "_router", output._Router())
    output.install()
    print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")  # deepspeed/comm/torch.py
    print("step 1/10  loss 5.4")
    # as Python's showwarning writes a warning in a rank (under pytest, warnings.warn is recorded instead)
    sys.stderr.write(warnings.formatwarning("`is_gradient_checkpointing` is deprecated and will be removed in v6.",
                                            FutureWarning, "modeling_utils.py", 3312))
    sys.stderr.write(warnings.formatwarning("a user's own warning", UserWarning, "my_model.py", 7))
    output.open_log(tmp_path, 1, verbose=False)  # lines before the log opens are kept for it
    output.write_log_only("Traceback (most recent call last):\n  ...\nValueError: boom\n")
    log = (tmp_path / "ranks" / "rank1.log").read_text()
    assert console_out.getvalue() == "step 1/10  loss 5.4\n"
    assert "a user's own warning" in console_err.getvalue()
    assert "is_gradient_checkpointing" not in console_err.getvalue() and "Traceback" not in console_err.getvalue()
    for line in ("built successfully", "is_gradient_checkpointing", "a user's own warning", "ValueError: boom"):
        assert line in log
    output.open_log(tmp_path, 1, verbose=True)
    print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")
    assert "built successfully" in console_out.getvalue()  # --verbose shows it again
