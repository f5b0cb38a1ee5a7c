"""dstrain run starts DeepSpeed's launcher and the ranks while its own checks still run
(dstrain/launcher/early_start.py): the ranks wait at a gate, and a check that fails, or a SIGTERM
during the checks, ends them before they touch anything. Real launcher, CPU ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher import TINY, assert_ok, losses

pytestmark = pytest.mark.integration

SLOW_MODEL = '''
import time, torch
def build():
    if torch.empty(0).device.type == "meta":  # the check in `dstrain run`: long enough to stop it there
        time.sleep(60)
    return torch.nn.Linear(4, 1)
'''


def _run(tmp_path: Path, run_dir: Path, *sets: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "dstrain.cli", "run", "--preset", "stage2", "--accelerator", "cpu", "--gpus", "2",
            "--run-dir", str(run_dir)]
    for item in (*TINY, *sets):
        args += ["--set", item]
    gates = tmp_path / "tmp"
    gates.mkdir(exist_ok=True)
    return subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(gates)})


def _processes_naming(text: str) -> list[int]:
    """Live processes whose command line holds `text` (the run directory is the ranks' argument)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _gate_folders(tmp_path: Path) -> list[Path]:
    """The start gates' temporary folders left in the run's TMPDIR (each run removes its own)."""
    return list((tmp_path / "tmp").glob("dstrain-start-*"))


def _wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def test_ranks_started_during_the_checks_train_and_leave_no_gate_behind(tmp_path):
    """Also the run of train.save_checkpoints=false (formerly a one-rank run of its own in test_run.py): it trains
    and evaluates, and writes no checkpoint, though save_every asks for one every step."""
    run_dir = tmp_path / "ok"
    process = _run(tmp_path, run_dir, "train.max_steps=3", "train.save_every=1", "train.log_every=1",
                   "train.save_checkpoints=false")
    out, err = process.communicate(timeout=600)
    assert_ok(subprocess.CompletedProcess(process.args, process.returncode, out, err))
    assert "ready in" in out and "step 3/3" in out
    assert _gate_folders(tmp_path) == []
    assert sorted(losses(run_dir)) == [1, 2, 3]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("eval_loss" in record for record in records)  # the final evaluation still runs
    checkpoints = run_dir / "checkpoints"
    assert not checkpoints.exists() or not any(checkpoints.iterdir())


def test_a_check_that_fails_ends_the_ranks_started_early_and_writes_nothing(tmp_path):
    run_dir = tmp_path / "bad"
    # The data file is checked in `dstrain run` (after the ranks start) and is missing.
    process = _run(tmp_path, run_dir, "data.source=text", f"data.paths=[{tmp_path / 'missing.txt'}]")
    out, err = process.communicate(timeout=300)
    assert process.returncode == 2, out + err
    assert "missing.txt" in err and "Traceback" not in err + out
    assert not run_dir.exists()
    assert _wait_for(lambda: not _processes_naming(str(run_dir)), 10), "ranks outlived the failed check"
    assert _gate_folders(tmp_path) == []


def test_sigterm_during_the_checks_stops_the_ranks_started_early(tmp_path):
    (tmp_path / "slowmodel.py").write_text(SLOW_MODEL)
    run_dir = tmp_path / "stopped"
    process = _run(tmp_path, run_dir, "model.name=slowmodel:build")
    # The launcher (its command names the run directory, as dstrain's own does) starts while the model check sleeps.
    assert _wait_for(lambda: bool(set(_processes_naming(str(run_dir))) - {process.pid}), 60), "no launcher started early"
    time.sleep(1)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM, out + err
    assert "SIGTERM: stopped before training started" in out and "Traceback" not in err
    assert not run_dir.exists()
    assert _wait_for(lambda: not _processes_naming(str(run_dir)), 10), "ranks outlived the stop"
    assert _gate_folders(tmp_path) == []


def test_early_start_is_on_by_default_except_for_zero3_and_the_switch_decides_either_way(monkeypatch):
    """ZeRO-3 rows trained slower with early start (docs/benchmarks.md, finding 27): unset, it is off there;
    DSTRAIN_EARLY_START=1 or 0 decides for any stage."""
    from dstrain.launcher.early_start import wanted

    stage = {n: {"zero_optimization": {"stage": n}} for n in (1, 2, 3)}
    monkeypatch.delenv("DSTRAIN_EARLY_START", raising=False)
    assert [wanted(stage[n]) for n in (1, 2, 3)] == [True, True, False]
    assert wanted({}) is True  # no zero_optimization section: stage 0
    monkeypatch.setenv("DSTRAIN_EARLY_START", "1")
    assert wanted(stage[3]) is True
    monkeypatch.setenv("DSTRAIN_EARLY_START", "off")
    assert wanted(stage[2]) is False
