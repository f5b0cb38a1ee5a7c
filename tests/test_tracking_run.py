"""One real run (2 CPU ranks, the deepspeed launcher) with every tracker on: what reaches TensorBoard, the
CSV and W&B (offline, when installed), the end-of-run summary and next commands, `dstrain report`, and
the profile of one step on both ranks."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import re
from pathlib import Path

import pytest

from launcher import assert_ok, dstrain, run_tiny

pytestmark = pytest.mark.integration

HAS_WANDB = importlib.util.find_spec("wandb") is not None


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """The one run both tests read (a launch costs ~12 s): every tracker on, the user's class among them
    (tests/user_code/usermods.py; entry points import from where dstrain runs)."""
    run_dir = tmp_path_factory.mktemp("tracked") / "run"
    trackers = "tensorboard,csv,wandb," if HAS_WANDB else "tensorboard,csv,"
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(Path(__file__).parent / "user_code")
        result = run_tiny(run_dir, "stage2", "train.max_steps=4", "train.log_every=2", "train.eval_every=4",
                          "train.save_every=4", "train.warmup_steps=1", "train.lr=0.002",
                          f"train.log_to=[{trackers}usermods:JsonLinesTracker]",
                          "profile.steps=1", "profile.start_after=2", "profile.ranks=all",
                          env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    return run_dir, result


def test_a_tracked_run_fills_tensorboard_csv_wandb_prints_its_summary_and_reports(tracked):
    run_dir, result = tracked
    assert_ok(result)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    for tag in ("train/loss", "train/lr", "train/grad_norm", "speed/tokens_per_s", "speed/tflops_per_device",
                "speed/data_wait_ms", "speed/step_time_ms", "memory/host_rss_gib"):
        assert [e.step for e in acc.Scalars(tag)] == [2, 4], tag
    assert [e.step for e in acc.Scalars("eval/eval_loss")] == [4]
    grad_norms = [e.value for e in acc.Scalars("train/grad_norm")]
    assert all(math.isfinite(g) and g > 0 for g in grad_norms)  # ZeRO-2 keeps the norm before clipping

    rows = list(csv.DictReader((run_dir / "metrics.csv").read_text().splitlines()))
    train_rows = [r for r in rows if r["loss"]]
    assert [r["step"] for r in train_rows] == ["2", "4"]
    assert [float(r["grad_norm"]) for r in train_rows] == pytest.approx(grad_norms)
    assert all(float(r["tokens_per_s"]) > 0 and float(r["host_rss_gib"]) > 0 for r in train_rows)
    assert [r["step"] for r in rows if r["eval_loss"]] == ["4"]

    if HAS_WANDB:
        offline = list((run_dir / "wandb").glob("offline-run-*"))
        assert len(offline) == 1 and list(offline[0].glob("run-*.wandb"))

    out = result.stdout
    # Not a terminal: one plain line per log step instead of the bar, with the same facts and the ETA.
    assert re.search(r"step 4/4  loss \d+\.\d{4}  lr \S+  gnorm \S+  [\d,]+ tok/s  .* eta 0m00s", out), out
    assert "summary: 4 steps, wall time " in out and "rollbacks 0" in out
    assert f"last complete checkpoint: {run_dir}/checkpoints/step00000004" in out
    assert f"  dstrain eval --run-dir {run_dir} --accelerator cpu" in out
    assert f"  dstrain convert-checkpoint {run_dir}/checkpoints {run_dir}/model.safetensors" in out
    assert f"  dstrain report {run_dir} -o {run_dir}/report.html" in out

    report = dstrain("report", str(run_dir))
    assert report.returncode == 0, report.stderr
    assert (run_dir / "report.html").is_file() and (run_dir / "report-grad_norm.png").is_file()
    assert "step00000004" in report.stdout


def test_a_user_tracker_class_in_log_to_gets_what_metrics_jsonl_gets(tracked):
    """train.log_to: usermods:JsonLinesTracker (tests/user_code/usermods.py, a class written as a user would):
    rank 0 opens it with the run's hyper-parameters, sends it each logged step and evaluation, closes it."""
    run_dir, result = tracked
    assert_ok(result)
    records = [json.loads(line) for line in (run_dir / "user_tracker.jsonl").read_text().splitlines()]
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[0] == {"opened_at": 0, "lr": 0.002}
    assert [(r["step"], r["loss"]) for r in records if "loss" in r] == \
        [(r["step"], r["loss"]) for r in logged if "loss" in r]
    assert [r["step"] for r in records if "loss" in r] == [2, 4]
    assert [r["step"] for r in records if "eval_loss" in r] == [4]
    assert records[-1] == {"closed": True}


def test_profile_steps_write_each_ranks_trace_and_summary_and_rank0_prints_it(tracked):
    """profile.steps=1 after 2 steps, every rank: a Chrome trace of real operators per rank, a summary file
    each, and rank 0's summary lines once in the output (a CPU run: the host's operator table)."""
    run_dir, result = tracked
    assert_ok(result)
    import gzip
    for rank in (0, 1):
        with gzip.open(run_dir / "profile" / f"rank{rank}.trace.json.gz", "rt") as f:
            names = {e.get("name") for e in json.load(f)["traceEvents"]}
        assert {"aten::mm", "aten::addmm"} & names, sorted(n for n in names if n)[:20]
        summary = (run_dir / "profile" / f"summary-rank{rank}.txt").read_text()
        assert summary.startswith(f"profiled 1 optimizer step(s) after 2 on rank {rank}; trace: "), summary[:200]
        assert "no device activity recorded" in summary and "Self CPU" in summary
        # the loop's phases, marked while the profile runs: each took some of the host's time
        phases = re.search(r"host time a step in the loop's forward / backward / step: (\S+) / (\S+) / (\S+) ms",
                           summary)
        assert phases and all(float(v.replace(",", "")) > 0 for v in phases.groups()), summary[:600]
    assert not list((run_dir / "profile").glob("*.partial*"))
    assert result.stdout.count("profiled 1 optimizer step(s) after 2 on rank 0") == 1, result.stdout
    assert "on rank 1" not in result.stdout
