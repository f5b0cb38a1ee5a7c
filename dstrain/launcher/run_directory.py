"""Writing the run directory before the ranks start: its checks (writable, owned by no other job,
no foreign checkpoints),
the run files the ranks read (names in dstrain/rundir.py), and the universal copy of a checkpoint saved by another world size.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import yaml
from rich.console import Console

from dstrain.checkpoints import check_tag, tag_dirs
from dstrain.config.layers import flatten
from dstrain.config.resolve import ResolvedConfig, redact
from dstrain.console_text import outside
from dstrain.errors import UserError
from dstrain.launcher.ownership import RunDirLock, acquire
from dstrain.rundir import CHECKPOINTS, CONFIG, DS_CONFIG, HEALTH, RANKS, SECRETS, LaunchInfo, write_atomic


def default_run_dir(resolved: ResolvedConfig) -> Path:
    return Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{resolved.preset or 'custom'}"


def prepare_run_dir(run_dir: Path, resuming: bool, job: str | None = None) -> RunDirLock:
    """Create the directory and take its lock (ownership.py) before anything in it is written; then
    refuse a fresh run into a directory that holds checkpoints. The caller releases the lock."""
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError.single("is a file, not a directory", f"--run-dir {run_dir}",
                               "name a directory (it is created if missing)")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write_test{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise UserError.single(f"cannot write the run directory: {err.strerror}", f"--run-dir {run_dir}",
                               "choose a writable directory with free space")
    lock = acquire(run_dir, f"--run-dir {run_dir}", job)
    try:
        refuse_checkpoints(run_dir, resuming)
    except UserError:
        lock.release()
        raise
    if not resuming:  # a fresh start owes nothing to an earlier attempt's rollbacks
        (run_dir / HEALTH).unlink(missing_ok=True)
    return lock


def refuse_checkpoints(run_dir: Path, resuming: bool) -> None:
    """A fresh run (no --resume) must not start in a directory that holds checkpoints (damaged ones
    too): its saves would mix with them. `--dry-run` checks this as the run does."""
    if not resuming and any(check_tag(d).found for d in tag_dirs(run_dir / CHECKPOINTS)):
        raise UserError.single("this run directory already holds checkpoints", f"--run-dir {run_dir}",
                               "continue it with --resume latest, or choose another --run-dir")


def write_run_dir(run_dir: Path, resolved: ResolvedConfig, launch_info: LaunchInfo,
                  own_ranks: range | None = None) -> None:
    config = resolved.config.model_dump(mode="json")
    secrets = {path: value for path, value in flatten(resolved.ds_config).items()
               if flatten(redact(resolved.ds_config)).get(path) != value}
    try:
        write_atomic(run_dir / CONFIG, yaml.safe_dump(redact(config), sort_keys=False))
        write_atomic(run_dir / DS_CONFIG, json.dumps(redact(resolved.ds_config), indent=2))
        launch_info.write(run_dir)
        if secrets:
            secret_file = run_dir / SECRETS
            write_atomic(secret_file, json.dumps(secrets))
            secret_file.chmod(0o600)
        (run_dir / RANKS).mkdir(exist_ok=True)
        for stale in (run_dir / RANKS).glob("rank*"):
            # With --no-ssh, other nodes sharing this directory may already have started: their
            # records are theirs to replace. Ranks past the new world size belong to no node.
            rank = int(stale.name[4:].split(".")[0])
            if own_ranks is None or rank in own_ranks or rank >= launch_info.world_size:
                stale.unlink(missing_ok=True)
    except OSError as err:
        raise UserError.single(f"cannot write the run directory: {err.strerror}", f"--run-dir {run_dir}",
                               "choose a writable directory with free space")


def universal_copy(checkpoints: Path, tag: str, run_dir: Path) -> Path:
    """The universal form of one checkpoint, converted on first use and reused after."""
    from dstrain.tools.convert import to_universal
    target = (run_dir / "universal").resolve()
    if not (target / tag).is_dir():
        Console(highlight=False).print(f"converting {outside(tag)} to a universal checkpoint in {outside(target)} ...")
        to_universal(checkpoints, target, tag=tag)
    return target
