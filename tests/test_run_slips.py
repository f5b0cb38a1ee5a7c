"""Slips met on the way to a fine-tuning run, each caught (or warned about) before anything starts, with
its fix: a model folder named without hf:, a warmup as long as the run, and `--resume` without
--config (the run directory's own config is used). `--dry-run` refusing a run directory that holds
checkpoints is checked after a real run, in tests/test_hf_runs.py."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from hf_models import save_tiny_llama

from dstrain.cli import app
from dstrain.config.resolve import resolve
from dstrain.errors import UserError

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("llama") / "model")


def cli(tmp_path, monkeypatch, *args: str):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    result = CliRunner().invoke(app, list(args))
    assert "Traceback" not in result.output
    return result.exit_code, " ".join(result.output.split())


@pytest.mark.parametrize("export", ["false", "hf"])
def test_a_model_folder_without_hf_asks_whether_hf_was_meant(llama_dir, export):
    with pytest.raises(UserError) as caught:
        resolve("stage2", None, [f"model.name={llama_dir}", f"train.export_final={export}"], world_size=2,
                accelerator="cpu", env={})
    message = " ".join(str(caught.value).split())
    assert f"--set: model.name: {llama_dir} is a folder, not a model name" in message
    assert f"did you mean hf:{llama_dir}?" in message
    assert "safetensors" not in message  # export_final: hf's own fix would be the wrong one here
    assert len(caught.value.problems) == 1


def test_a_warmup_as_long_as_the_run_is_one_warning_with_the_fix():
    resolved = resolve("stage2", None, ["train.max_steps=10"], world_size=2, accelerator="cpu", env={})
    assert resolved.config.train.warmup_steps == 20  # the default
    [warning] = [w for w in resolved.warnings if "warmup" in w]
    assert warning.startswith("train.warmup_steps: warmup of 20 steps >= train.max_steps (10)")
    assert "never reaches train.lr" in warning and "--set train.warmup_steps=1" in warning
    quiet = resolve("stage2", None, ["train.max_steps=10", "train.warmup_steps=2"], world_size=2, accelerator="cpu",
                    env={})
    assert not [w for w in quiet.warnings if "warmup" in w]


def _launch_info(resolved):
    """launch.json of a 2-rank CPU run of `resolved`, as `dstrain run` writes it."""
    from dstrain import __version__
    from dstrain.rundir import LaunchInfo
    return LaunchInfo(world_size=2, accelerator="cpu", verbose=False, preset=resolved.preset,
                      config_hash=resolved.config_hash(), dstrain_version=__version__, hang_timeout_s=0, resume=None)


def test_resume_without_config_continues_with_the_run_directorys_own_config(llama_dir, tmp_path, monkeypatch):
    from dstrain.launcher.run_directory import write_run_dir
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    started = resolve("stage3", None, [f"model.name=hf:{llama_dir}", "data.tokenizer=byte", "data.seq_len=16",
                                       "train.micro_batch_size=2", "train.lr=0.005", "model.lora={r: 4}"],
                      world_size=2, accelerator="cpu", env={})
    write_run_dir(run_dir, started, _launch_info(started))
    code, output = cli(tmp_path, monkeypatch, "run", "--dry-run", "--accelerator", "cpu", "--gpus", "2",
                       "--run-dir", str(run_dir), "--resume", "auto", "--set", "train.max_steps=300")
    assert code == 0, output
    assert f"the run directory's own config {run_dir / 'config.yaml'} is used" in output
    assert "preset stage3, ZeRO stage 3" in output and f"model: hf:{llama_dir}" in output
    assert f"batch: micro 2 x grad accum {started.config.train.grad_accum_steps} x world 2" in output


def test_resume_with_a_config_of_its_own_keeps_it(tmp_path, monkeypatch):
    from dstrain.launcher.run_directory import write_run_dir
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    started = resolve("stage3", None, ["train.micro_batch_size=2"], world_size=2, accelerator="cpu", env={})
    write_run_dir(run_dir, started, _launch_info(started))
    code, output = cli(tmp_path, monkeypatch, "run", "--dry-run", "--accelerator", "cpu", "--gpus", "2",
                       "--run-dir", str(run_dir), "--resume", "auto", "--preset", "stage2")
    assert code == 0, output
    assert "own config" not in output and "preset stage2, ZeRO stage 2" in output
