"""Checkpoint integrity (issue 18): completion marks record each file's size and SHA-256; resume skips
a damaged tag naming the file and falls back to the newest intact one; `dstrain checkpoint verify`
and `convert-checkpoint` refuse damaged tags; marks of older dstrain versions still resume.

Tags here are written by the real `checkpointing.save` (its barriers, gathers, RNG file and mark) in a
one-rank gloo group, with a stand-in for DeepSpeed's `save_checkpoint` that writes shard files of
DeepSpeed's names; the launcher-level case (real DeepSpeed shards, 2 ranks) is in test_reliability.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dstrain.checkpoints import COMPLETE_MARK, LATEST, assign_files, check_tag, find_resume, tag_for
from dstrain.cli import app
from dstrain.errors import UserError
from dstrain.rundir import CHECKPOINTS

MODEL = "mp_rank_00_model_states.pt"
OPTIM = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


class ShardWriter:
    """Stands in for engine.save_checkpoint: writes a model and an optimizer shard of DeepSpeed's names."""

    def save_checkpoint(self, directory, tag, client_state, save_latest):
        tag_dir = Path(directory) / tag
        tag_dir.mkdir(parents=True, exist_ok=True)
        (tag_dir / MODEL).write_bytes(os.urandom(50_000))
        (tag_dir / OPTIM).write_bytes(os.urandom(150_000))


def save_tags(run_dir: Path, *steps: int, hashes: bool = True, config_hash: str = "h") -> Path:
    from dstrain.rank.checkpointing import save
    for step in steps:
        save(ShardWriter(), run_dir, step, {"config_hash": config_hash}, keep_last=5, hashes=hashes)
    return run_dir / CHECKPOINTS


def truncate(path: Path, keep: int = 1000) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:keep])


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def verify_cli(*args: str):
    return CliRunner().invoke(app, ["checkpoint", "verify", *args], env={"COLUMNS": "200"})


def flat(text: str) -> str:
    return " ".join(text.split())


# ------------------------------------------------------------------ what the mark records

def test_the_mark_records_every_files_size_and_sha256(tmp_path, one_rank_group):
    tag_dir = save_tags(tmp_path, 2) / tag_for(2)
    files = json.loads((tag_dir / COMPLETE_MARK).read_text())["files"]
    assert sorted(files) == [MODEL, "rng_rank0.pt", OPTIM]
    for name, record in files.items():
        data = (tag_dir / name).read_bytes()
        assert record == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_checkpoint_hashes_off_records_sizes_only(tmp_path, one_rank_group):
    tag_dir = save_tags(tmp_path, 2, hashes=False) / tag_for(2)
    files = json.loads((tag_dir / COMPLETE_MARK).read_text())["files"]
    assert files[OPTIM] == {"size": 150_000}


def test_each_file_is_hashed_once_by_a_rank_that_sees_it_preferring_its_writer():
    shared = {MODEL: 50, "zero_pp_rank_0_mp_rank_00_optim_states.pt": 90, "rng_rank0.pt": 1, "rng_rank1.pt": 1,
              "zero_pp_rank_1_mp_rank_00_optim_states.pt": 90, "extra.bin": 40}
    assert assign_files([shared, shared]) == [
        ["zero_pp_rank_0_mp_rank_00_optim_states.pt", MODEL, "rng_rank0.pt"],
        ["zero_pp_rank_1_mp_rank_00_optim_states.pt", "extra.bin", "rng_rank1.pt"]]
    # Nodes without a shared file system: each sees only its own ranks' files.
    node0 = {MODEL: 50, "zero_pp_rank_0_mp_rank_00_optim_states.pt": 90, "rng_rank0.pt": 1}
    node1 = {"zero_pp_rank_1_mp_rank_00_optim_states.pt": 90, "rng_rank1.pt": 1}
    assert assign_files([node0, node1]) == [
        ["zero_pp_rank_0_mp_rank_00_optim_states.pt", MODEL, "rng_rank0.pt"],
        ["zero_pp_rank_1_mp_rank_00_optim_states.pt", "rng_rank1.pt"]]


# ------------------------------------------------------------------ dstrain checkpoint verify

def test_verify_passes_an_intact_run_and_says_it_is_safe_to_resume_or_convert(tmp_path, one_rank_group):
    save_tags(tmp_path, 2, 4)
    result = verify_cli(str(tmp_path))
    assert result.exit_code == 0, result.output
    assert result.output.count("intact: resume, convert") == 2
    assert "sha256" in result.output and "newest intact tag: step00000004" in result.output


def test_verify_names_a_truncated_optimizer_shard(tmp_path, one_rank_group):
    tag_dir = save_tags(tmp_path, 2) / tag_for(2)
    truncate(tag_dir / OPTIM)
    result = verify_cli(str(tag_dir))
    assert result.exit_code == 2, result.output
    assert f"damaged: {tag_dir / OPTIM} truncated: 1000 bytes, the mark recorded 150000" in flat(result.output)
    assert "not safe to resume from or convert" in flat(result.output)


def test_verify_names_a_changed_byte_that_only_the_hash_shows(tmp_path, one_rank_group):
    tag_dir = save_tags(tmp_path, 2) / tag_for(2)
    flip_a_byte(tag_dir / MODEL)
    result = verify_cli(str(tag_dir))
    assert result.exit_code == 2, result.output
    assert f"damaged: {tag_dir / MODEL} changed: its SHA-256 differs" in flat(result.output)
    assert verify_cli(str(tag_dir), "--no-hashes").exit_code == 0  # same size: sizes alone cannot tell


def test_verify_names_a_missing_file(tmp_path, one_rank_group):
    tag_dir = save_tags(tmp_path, 2) / tag_for(2)
    (tag_dir / "rng_rank0.pt").unlink()
    result = verify_cli(str(tag_dir))
    assert result.exit_code == 2, result.output
    assert f"damaged: {tag_dir / 'rng_rank0.pt'} missing" in flat(result.output)


def test_verify_of_a_run_with_one_damaged_tag_fails_and_names_the_intact_one(tmp_path, one_rank_group):
    checkpoints = save_tags(tmp_path, 2, 4)
    truncate(checkpoints / tag_for(4) / OPTIM)
    result = verify_cli(str(tmp_path))
    output = flat(result.output)
    assert result.exit_code == 2, result.output
    assert "newest intact tag: step00000002 ('latest' names step00000004)" in output
    assert "1 damaged, 1 intact tag(s)" in output


def test_verify_does_not_import_torch(tmp_path, one_rank_group):
    save_tags(tmp_path, 2)
    code = ("import sys; from dstrain.cli import app\n"
            "try: app(['checkpoint', 'verify', sys.argv[1]])\n"
            "except SystemExit as end: assert end.code == 0, end.code\n"
            "assert 'torch' not in sys.modules, 'torch was imported'")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


# ------------------------------------------------------------------ resume

def test_resume_latest_falls_back_past_a_truncated_tag_naming_the_file(tmp_path, one_rank_group):
    checkpoints = save_tags(tmp_path, 2, 4)
    truncate(checkpoints / tag_for(4) / OPTIM)
    found, notes = find_resume("latest", tmp_path)
    assert found.tag == "step00000002"
    assert notes == [f"'latest' names step00000004, which is damaged ({OPTIM} truncated: 1000 bytes, the mark "
                     "recorded 150000); resuming from step00000002, the newest intact checkpoint"]


def test_resume_of_a_named_damaged_tag_is_refused_with_the_file_and_the_intact_tags(tmp_path, one_rank_group):
    checkpoints = save_tags(tmp_path, 2, 4)
    (checkpoints / tag_for(4) / MODEL).unlink()
    with pytest.raises(UserError) as caught:
        find_resume("step00000004", tmp_path)
    message = flat(str(caught.value))
    assert f"--resume step00000004: checkpoint step00000004 is damaged: {MODEL} missing" in message
    assert "intact tags here: step00000002" in message


def test_a_changed_byte_is_caught_at_resume_only_when_hashes_are_asked_for(tmp_path, one_rank_group):
    checkpoints = save_tags(tmp_path, 2, 4)
    flip_a_byte(checkpoints / tag_for(4) / OPTIM)
    assert find_resume("latest", tmp_path)[0].tag == "step00000004"  # sizes match: not noticed
    found, notes = find_resume("latest", tmp_path, hashes=True)
    assert found.tag == "step00000002"
    assert f"{OPTIM} changed: its SHA-256 differs" in notes[0]


def test_verify_hashes_on_resume_makes_dstrain_run_fall_back_past_a_changed_byte(tmp_path, one_rank_group):
    from dstrain.config.resolve import resolve
    run = ["run", "--preset", "stage2", "--accelerator", "cpu", "--gpus", "1", "--run-dir", str(tmp_path),
           "--resume", "latest", "--dry-run"]
    checkpoints = save_tags(tmp_path, 2, 4, config_hash=resolve("stage2", accelerator="cpu").config_hash())
    flip_a_byte(checkpoints / tag_for(4) / OPTIM)
    sizes_only = CliRunner().invoke(app, run, env={"COLUMNS": "200"})
    assert sizes_only.exit_code == 0, sizes_only.output
    assert "resume: step00000004" in sizes_only.output
    hashed = CliRunner().invoke(app, [*run, "--set", "train.verify_hashes_on_resume=true"], env={"COLUMNS": "200"})
    assert hashed.exit_code == 0, hashed.output
    assert f"'latest' names step00000004, which is damaged ({OPTIM} changed: its SHA-256 differs" in flat(hashed.output)
    assert "resume: step00000002" in hashed.output


def test_a_mark_without_sizes_from_an_older_dstrain_still_resumes_and_verifies(tmp_path, one_rank_group):
    checkpoints = save_tags(tmp_path, 2)
    mark_file = checkpoints / tag_for(2) / COMPLETE_MARK
    mark = json.loads(mark_file.read_text())
    mark["files"] = sorted(mark["files"])  # the older format: names only
    mark_file.write_text(json.dumps(mark))
    assert find_resume("latest", tmp_path) == (check_tag(checkpoints / tag_for(2)).found, [])
    result = verify_cli(str(checkpoints / tag_for(2)))
    assert result.exit_code == 0, result.output
    assert "files present; its mark, from an older dstrain, records no sizes" in flat(result.output)
    (checkpoints / tag_for(2) / OPTIM).unlink()  # a missing file is still caught
    with pytest.raises(UserError, match="no complete checkpoint"):
        find_resume("latest", tmp_path)


def test_a_run_from_latest_with_a_damaged_named_tag_is_refused_before_anything_starts(tmp_path, one_rank_group):
    checkpoints = save_tags(tmp_path, 2)
    truncate(checkpoints / tag_for(2) / OPTIM)
    assert (checkpoints / LATEST).read_text() == "step00000002"
    result = CliRunner().invoke(app, ["run", "--preset", "stage2", "--accelerator", "cpu", "--gpus", "1",
                                      "--run-dir", str(tmp_path), "--resume", "step00000002", "--dry-run"],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert f"checkpoint step00000002 is damaged: {OPTIM} truncated" in flat(result.output)
    assert "no intact tag here" in flat(result.output)


def test_a_new_run_into_a_directory_holding_only_damaged_checkpoints_is_refused(tmp_path, one_rank_group):
    checkpoints = save_tags(tmp_path, 2)
    truncate(checkpoints / tag_for(2) / OPTIM)
    result = CliRunner().invoke(app, ["run", "--preset", "stage2", "--accelerator", "cpu", "--gpus", "1",
                                      "--run-dir", str(tmp_path), "--set", "train.max_steps=1"],  # bounded if it ran
                                env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert "this run directory already holds checkpoints" in result.output


# ------------------------------------------------------------------ convert-checkpoint

def test_convert_refuses_a_damaged_tag_naming_the_file(tmp_path, one_rank_group):
    checkpoints = save_tags(tmp_path, 2)
    truncate(checkpoints / tag_for(2) / OPTIM)
    result = CliRunner().invoke(app, ["convert-checkpoint", str(checkpoints), str(tmp_path / "out.safetensors")],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert f"{checkpoints / tag_for(2)}: damaged checkpoint: {OPTIM} truncated" in flat(result.output)
    assert not (tmp_path / "out.safetensors").exists()
