"""`dstrain eval`: a checkpoint's held-out loss, through the same launcher and ranks as `dstrain run`.

One tiny run is trained once for the module (checkpoints and train-loop evaluations at steps 2 and
4); evaluating a checkpoint must give exactly the eval loss the train loop logged at that step.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dstrain.cli import app
from launcher import assert_ok, dstrain, run_tiny

STEPS = ("train.max_steps=4", "train.save_every=2", "train.eval_every=2", "train.log_every=1", "train.keep_last=2")


def train_eval_losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["eval_loss"] for row in rows if "eval_loss" in row}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("eval") / "run"
    assert_ok(run_tiny(run_dir, "stage2", *STEPS))
    return run_dir


def run_files(run_dir: Path) -> dict[str, bytes]:
    names = ["config.yaml", "ds_config.json", "launch.json", "metrics.jsonl", "checkpoints/latest"]
    return {name: (run_dir / name).read_bytes() for name in names}


@pytest.mark.integration
def test_eval_of_the_latest_checkpoint_equals_the_train_loops_eval_at_that_step(trained):
    before = run_files(trained)
    result = dstrain("eval", "--run-dir", str(trained), "--accelerator", "cpu")
    assert_ok(result)
    saved = json.loads((trained / "eval.json").read_text())
    assert saved["step"] == 4 and saved["tag"] == "step00000004" and saved["world_size"] == 2
    assert saved["eval_loss"] == pytest.approx(train_eval_losses(trained)[4], rel=1e-6)
    assert saved["perplexity"] == pytest.approx(math.exp(saved["eval_loss"]))
    assert f"eval loss {saved['eval_loss']:.4f}" in result.stdout
    # train.eval_batches=2 global batches of 4 x 2 ranks: 16 distinct held-out windows, said as covered
    assert saved["eval_samples"] == 16 and saved["eval_examples"] == 16 and "over 16 held-out samples" in result.stdout
    assert run_files(trained) == before  # the run's own files are untouched: evaluation runs in eval/


@pytest.mark.integration
def test_eval_of_an_older_tag_loads_that_checkpoint(trained):
    assert_ok(dstrain("eval", "--run-dir", str(trained), "--resume", "step00000002", "--accelerator", "cpu"))
    saved = json.loads((trained / "eval.json").read_text())
    assert saved["step"] == 2
    assert saved["eval_loss"] == pytest.approx(train_eval_losses(trained)[2], rel=1e-6)
    assert saved["eval_loss"] != pytest.approx(train_eval_losses(trained)[4], rel=1e-6)


def test_eval_of_a_directory_that_is_not_a_run_exits_2(tmp_path):
    result = CliRunner().invoke(app, ["eval", "--run-dir", str(tmp_path)])
    assert result.exit_code == 2 and "not a dstrain run directory" in result.output


def test_eval_of_a_run_without_checkpoints_exits_2(tmp_path):
    for name in ("config.yaml", "ds_config.json", "launch.json"):
        (tmp_path / name).write_text("{}")
    result = CliRunner().invoke(app, ["eval", "--run-dir", str(tmp_path)])
    assert result.exit_code == 2 and "no complete checkpoint" in result.output


def test_eval_of_an_unknown_tag_exits_2(tmp_path):
    for name in ("config.yaml", "ds_config.json", "launch.json"):
        (tmp_path / name).write_text("{}")
    (tmp_path / "checkpoints").mkdir()
    result = CliRunner().invoke(app, ["eval", "--run-dir", str(tmp_path), "--resume", "step00000099"])
    assert result.exit_code == 2 and "no such checkpoint" in result.output


@pytest.mark.integration
def test_eval_of_a_run_whose_launch_json_this_dstrain_cannot_read_exits_2_naming_the_file(trained, tmp_path):
    import shutil
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    (copy / "launch.json").write_text(json.dumps({"world_size": 2, "accelerator": "cpu"}))
    result = CliRunner().invoke(app, ["eval", "--run-dir", str(copy)], env={"COLUMNS": "250"})
    assert result.exit_code == 2, result.output
    assert f"{copy / 'launch.json'}: not a launch file of this dstrain version" in " ".join(result.output.split())
    assert "Traceback" not in result.output
