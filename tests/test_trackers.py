"""Trackers (train.log_to) and rank 0's MetricsLog: real TensorBoard event files read back with
TensorBoard's own EventAccumulator, the real CSV file, a real W&B offline run when wandb is installed."""

from __future__ import annotations

import csv
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from dstrain.rank.metrics import MetricsLog
from dstrain.rank.trackers import CsvTracker, TensorBoardTracker, flat_hparams, open_trackers

HPARAMS = flat_hparams({"train": {"lr": 1e-3, "log_to": ["tensorboard"], "precision": "fp32"}, "world_size": 2})


def _accumulator(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _scalars(acc, tag):
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_tensorboard_tracker_writes_scalars_events_and_hparams_tensorboard_reads_back(tmp_path):
    tracker = TensorBoardTracker(tmp_path, HPARAMS, start_step=0)
    tracker.log_metrics(1, {"loss": 5.0, "grad_norm": 2.5, "lr": 1e-3})
    tracker.log_metrics(2, {"loss": 4.0, "grad_norm": 1.5, "lr": 9e-4})
    tracker.log_metrics(2, {"eval_loss": 4.2})
    tracker.log_event(2, "rollback", {"from_step": 2, "to_step": 0})
    tracker.close()

    acc = _accumulator(tmp_path)
    assert _scalars(acc, "train/loss") == [(1, 5.0), (2, 4.0)]
    assert _scalars(acc, "train/grad_norm") == [(1, 2.5), (2, 1.5)]
    assert _scalars(acc, "eval/eval_loss") == [(2, pytest.approx(4.2))]
    assert _scalars(acc, "events/rollback") == [(2, 1.0)]
    text = acc.Tensors("events/rollback/text_summary")[0].tensor_proto.string_val[0].decode()
    assert text == "rollback at step 2: from_step=2, to_step=0"
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData
    start = HParamsPluginData.FromString(acc.PluginTagToContent("hparams")["_hparams_/session_start_info"])
    hparams = start.session_start_info.hparams
    assert hparams["train.lr"].number_value == 1e-3 and hparams["train.log_to"].string_value == '["tensorboard"]'


def test_tensorboard_tracker_resumed_at_a_step_hides_the_steps_logged_after_it(tmp_path):
    first = TensorBoardTracker(tmp_path, HPARAMS, start_step=0)
    for step in (1, 2, 3):
        first.log_metrics(step, {"loss": float(10 - step)})
    first.close()
    resumed = TensorBoardTracker(tmp_path, HPARAMS, start_step=2)  # the last checkpoint was at step 2
    resumed.log_metrics(3, {"loss": 1.0})
    resumed.close()

    assert _scalars(_accumulator(tmp_path), "train/loss") == [(1, 9.0), (2, 8.0), (3, 1.0)]


def test_tensorboard_tracker_rewound_after_a_rollback_shows_the_steps_trained_again(tmp_path):
    tracker = TensorBoardTracker(tmp_path, HPARAMS, start_step=0)
    for step in (1, 2, 3):
        tracker.log_metrics(step, {"loss": float(10 - step)})
    tracker.rewind(1)  # rolled back to the checkpoint at step 1
    tracker.log_metrics(2, {"loss": 2.0})
    tracker.log_metrics(3, {"loss": 1.0})
    tracker.close()

    assert _scalars(_accumulator(tmp_path), "train/loss") == [(1, 9.0), (2, 2.0), (3, 1.0)]


def test_csv_tracker_appends_across_a_resume_under_one_header(tmp_path):
    tracker = CsvTracker(tmp_path, HPARAMS, start_step=0)
    tracker.log_metrics(1, {"loss": 5.0, "grad_norm": 2.5})
    tracker.log_event(1, "rollback", {"to_step": 0, "skipped_samples": [3, 4]})
    tracker.close()
    again = CsvTracker(tmp_path, HPARAMS, start_step=1)
    again.log_metrics(2, {"loss": 4.0, "eval_loss": 4.5})
    again.close()

    text = (tmp_path / "metrics.csv").read_text()
    assert text.count("time,step,event,loss") == 1
    rows = list(csv.DictReader(text.splitlines()))
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in rows] == [("1", "5.0", "2.5"), ("1", "", ""), ("2", "4.0", "")]
    assert rows[1]["event"] == "rollback"
    assert json.loads(rows[1]["details"]) == {"to_step": 0, "skipped_samples": [3, 4]}
    assert rows[2]["eval_loss"] == "4.5"


@pytest.mark.slow
def test_wandb_tracker_offline_writes_run_files_and_a_resume_keeps_the_run_id(tmp_path, monkeypatch):
    from dstrain.rank.trackers import WandbTracker
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = WandbTracker(tmp_path, HPARAMS, start_step=0)
    tracker.log_metrics(1, {"loss": 5.0, "grad_norm": 2.5})
    tracker.log_event(1, "rollback", {"to_step": 0})
    tracker.close()
    run_id = (tmp_path / "wandb" / "dstrain_run_id").read_text()
    offline = list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(offline) == 1 and list(offline[0].glob("run-*.wandb"))

    WandbTracker(tmp_path, HPARAMS, start_step=1).close()
    assert (tmp_path / "wandb" / "dstrain_run_id").read_text() == run_id


def _metrics_log(tmp_path, trackers):
    return MetricsLog(tmp_path, True, max_steps=10, tokens_per_step=1024, flops_per_token=6e6, world=2,
                      device=torch.device("cpu"), trackers=trackers)


def test_metrics_log_sends_steps_evaluations_and_events_to_jsonl_and_every_tracker(tmp_path):
    metrics = _metrics_log(tmp_path, open_trackers(["csv", "tensorboard"], tmp_path, HPARAMS, 0))
    metrics.start(0)
    metrics.log_step(2, 5.0, 1e-3, elapsed=0.5, steps=2, data_s=0.1, stats={"grad_norm": 1.25})
    metrics.log_eval(2, 4.5)
    metrics.log_event("rollback", 2, to_step=0, skipped_samples=[8, 9])
    metrics.finish(type("State", (), {"step": 2, "stopped_by": None})())

    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("event") for r in rows] == ["run_start", None, None, "rollback", "run_end"]
    step = rows[1]
    assert step["grad_norm"] == 1.25 and step["tokens_per_s"] == pytest.approx(1024 * 2 / 0.5)
    assert step["data_wait_ms"] == pytest.approx(50.0) and step["step_time_ms"] == pytest.approx(250.0)
    assert step["host_rss_gib"] > 0 and "mfu" not in step  # CPU: no peak, no MFU
    assert rows[3] == {"event": "rollback", "step": 2, "to_step": 0, "skipped_samples": [8, 9], "time": rows[3]["time"]}
    csv_rows = list(csv.DictReader((tmp_path / "metrics.csv").read_text().splitlines()))
    assert [r["event"] for r in csv_rows] == ["", "", "rollback"]
    acc = _accumulator(tmp_path)
    assert _scalars(acc, "train/grad_norm") == [(2, 1.25)]
    assert _scalars(acc, "events/rollback") == [(2, 1.0)]


def test_metrics_log_switches_off_a_failing_tracker_and_keeps_logging(tmp_path, capsys):
    broken = CsvTracker(tmp_path, HPARAMS, 0)
    broken.file.close()  # writing now raises ValueError, as a vanished disk would raise OSError
    metrics = _metrics_log(tmp_path, [broken])
    metrics.log_step(1, 5.0, 1e-3, elapsed=0.5, steps=1)
    metrics.log_step(2, 4.0, 1e-3, elapsed=0.5, steps=1)

    assert metrics.trackers == []
    assert capsys.readouterr().err.count("tracker csv failed and is switched off") == 1
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def test_a_tracker_whose_package_is_missing_stops_the_dry_run_with_exit_2_and_the_extra_to_install(tmp_path,
                                                                                                   monkeypatch):
    from typer.testing import CliRunner
    from dstrain.cli import app
    monkeypatch.setitem(sys.modules, "wandb", None)  # how Python blocks an import: find_spec says None
    run_dir = tmp_path / "run"
    result = CliRunner().invoke(app, ["run", "--preset", "stage2", "--accelerator", "cpu", "--gpus", "2", "--run-dir",
                                      str(run_dir), "--set", "train.log_to=[csv,wandb]", "--dry-run"])
    assert result.exit_code == 2, result.output
    assert "train.log_to (from --set): wandb is not installed" in result.output
    assert "pip install 'dstrain[wandb]'" in result.output and "Traceback" not in result.output
    assert not run_dir.exists()


def test_a_user_tracker_class_that_lacks_the_tracker_methods_stops_the_dry_run_with_exit_2(tmp_path, monkeypatch):
    from typer.testing import CliRunner
    from dstrain.cli import app
    monkeypatch.chdir(Path(__file__).parent / "user_code")  # entry points import from where dstrain runs
    result = CliRunner().invoke(app, ["run", "--preset", "stage2", "--accelerator", "cpu", "--gpus", "2", "--run-dir",
                                      str(tmp_path / "run"), "--set", "train.log_to=[csv,usermods:NotATracker]",
                                      "--dry-run"])
    assert result.exit_code == 2, result.output
    assert "train.log_to (from --set): tracker usermods:NotATracker lacks log_metrics, log_event, close" in result.output
    assert "Traceback" not in result.output


def test_an_unknown_tracker_name_is_refused_with_the_names_to_use(tmp_path):
    from typer.testing import CliRunner
    from dstrain.cli import app
    result = CliRunner().invoke(app, ["config", "--preset", "stage2", "--set", "train.log_to=[tensorbord]"])
    assert result.exit_code == 2, result.output
    assert "unknown tracker 'tensorbord': use tensorboard, wandb, csv, or your own class as 'module:Class'" \
        in result.output


def test_open_trackers_opens_a_user_tracker_class_named_module_colon_class(tmp_path, monkeypatch):
    monkeypatch.chdir(Path(__file__).parent / "user_code")
    trackers = open_trackers(["usermods:JsonLinesTracker"], tmp_path, {"train.lr": 0.5}, 0)
    metrics = _metrics_log(tmp_path, trackers)
    metrics.start(0)
    metrics.log_step(1, 5.0, 1e-3, elapsed=0.5, steps=1)
    metrics.rewind(0)  # a tracker without rewind: nothing to do, and it stays on
    metrics.close()
    records = [json.loads(line) for line in (tmp_path / "user_tracker.jsonl").read_text().splitlines()]
    assert records[0] == {"opened_at": 0, "lr": 0.5}
    assert records[1]["step"] == 1 and records[1]["loss"] == 5.0
    assert records[-1] == {"closed": True} and metrics.trackers == trackers
