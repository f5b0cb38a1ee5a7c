"""Checkpoints that never resume wrongly: complete marks, an atomic `latest`, retention.

DeepSpeed writes each rank's shards with `engine.save_checkpoint`; dstrain adds per-rank RNG
states, then, once every rank has written (a barrier), rank 0 writes a completion mark listing
every file of the tag, and only then points `latest` at it (write-then-rename, so a kill at
any moment leaves either the old or the new pointer). Resuming verifies the mark and the files,
and takes the last complete checkpoint saved, saying so when `latest` names another.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dstrain.errors import UserError

CHECKPOINTS = "checkpoints"
COMPLETE_MARK = "dstrain_complete.json"
LATEST = "latest"


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def write_atomic(path: Path, text: str) -> None:
    """Write via a temporary file and rename, so readers see the old or the new content, never half."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


@dataclass
class CompleteCheckpoint:
    directory: Path  # the checkpoints directory (what engine.load_checkpoint takes)
    tag: str
    step: int
    world_size: int
    mark: dict[str, Any]

    @property
    def path(self) -> Path:
        return self.directory / self.tag


# ---------------------------------------------------------------- saving (inside ranks)

def rng_state() -> dict[str, Any]:
    import numpy as np
    import torch
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(engine, run_dir: Path, step: int, client_state: dict[str, Any], keep_last: int) -> Path:
    """Save a checkpoint on every rank, mark it complete, move `latest`, prune old ones."""
    import torch
    import torch.distributed as dist

    directory = run_dir / CHECKPOINTS
    tag = tag_for(step)
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        _unmark(directory, tag)
    dist.barrier()  # no rank rewrites a tag while it still looks complete
    try:
        engine.save_checkpoint(str(directory), tag=tag, client_state=client_state, save_latest=False)
        torch.save(rng_state(), directory / tag / f"rng_rank{rank}.pt")
    except (OSError, RuntimeError) as err:
        _explain_write_failure(err, directory / tag)
        raise
    dist.barrier()  # every rank's files are on disk before the mark says so
    if rank == 0:
        files = sorted(str(p.relative_to(directory / tag)) for p in (directory / tag).rglob("*") if p.is_file())
        mark = {"step": step, "tag": tag, "world_size": world, "files": files, "time": time.time(),
                "config_hash": client_state.get("config_hash")}
        try:
            write_atomic(directory / tag / COMPLETE_MARK, json.dumps(mark, indent=1))
            write_atomic(directory / LATEST, tag)
        except OSError as err:
            _explain_write_failure(err, directory / tag)
            raise
        prune(directory, keep_last)
    dist.barrier()
    return directory / tag


def _unmark(directory: Path, tag: str) -> None:
    """Before a tag is written again (a run rewound with --resume <older tag> reaches its step),
    move `latest` off it and drop its mark: while rewritten it must not look complete."""
    mark = directory / tag / COMPLETE_MARK
    if not mark.exists():
        return
    latest = directory / LATEST
    if latest.is_file() and latest.read_text().strip() == tag:
        others = [c for c in complete_checkpoints(directory) if c.tag != tag]
        if others:
            write_atomic(latest, others[-1].tag)
        else:
            latest.unlink()
    mark.unlink()


def _explain_write_failure(err: Exception, tag_dir: Path) -> None:
    """Raise a failed write again as an error that names the checkpoint and the cause (torch reports a
    full disk only as 'iostream error' or 'unexpected pos'). Returns for other failures, such as a
    collective inside save_checkpoint failing because another rank died."""
    try:
        usage = shutil.disk_usage(tag_dir.parent)
        free, full = usage.free, usage.free < max(usage.total // 100, 1 << 20)
    except OSError:
        free, full = 0, False
    if not isinstance(err, OSError) and not full:
        return
    reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err).splitlines()[0]
    if full:
        reason = f"the disk is full ({free / 2**20:.1f} MiB free); {reason}"
    raise UserError.single(f"writing the checkpoint failed: {reason}", str(tag_dir),
                           "free space on that disk or choose a --run-dir with room for a checkpoint, then "
                           "continue with --resume latest (the last complete checkpoint is kept)") from err


def prune(directory: Path, keep_last: int) -> list[Path]:
    """Delete all but the last `keep_last` complete checkpoints saved, and incomplete ones older than
    the last one. The last complete checkpoint is never deleted."""
    complete = complete_checkpoints(directory)
    keep = {c.tag for c in complete[-max(keep_last, 1):]}
    newest_step = complete[-1].step if complete else -1
    removed = []
    for child in directory.iterdir():
        if not child.is_dir() or child.name in keep:
            continue
        step = _step_of(child)
        is_complete = any(c.tag == child.name for c in complete)
        if is_complete or (step is not None and step < newest_step):
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    return removed


# ---------------------------------------------------------------- finding (launcher and ranks)

def _step_of(tag_dir: Path) -> int | None:
    name = tag_dir.name
    return int(name[4:]) if name.startswith("step") and name[4:].isdigit() else None


def verify(tag_dir: Path) -> CompleteCheckpoint | None:
    """The checkpoint in `tag_dir` if its completion mark exists and every file it lists is there."""
    mark_path = tag_dir / COMPLETE_MARK
    try:
        mark = json.loads(mark_path.read_text())
        step, world_size, files, saved_at = int(mark["step"]), int(mark["world_size"]), mark["files"], mark["time"]
        intact = all((tag_dir / name).is_file() for name in files)
    except (OSError, ValueError, TypeError, KeyError):  # unreadable, or not a mark dstrain wrote
        return None
    if not intact or not isinstance(saved_at, (int, float)):
        return None
    return CompleteCheckpoint(tag_dir.parent, tag_dir.name, step, world_size, mark)


def complete_checkpoints(directory: Path) -> list[CompleteCheckpoint]:
    """Complete checkpoints under a checkpoints directory, in the order they were saved (oldest
    first): a run rewound with --resume <older tag> saves lower steps after higher ones."""
    if not directory.is_dir():
        return []
    found = [verify(child) for child in directory.iterdir() if child.is_dir()]
    return sorted((c for c in found if c), key=lambda c: (c.mark["time"], c.step))


def find_resume(spec: str, run_dir: Path) -> tuple[CompleteCheckpoint, list[str]]:
    """Resolve --resume (latest, a run dir, a checkpoints dir or a tag dir). Returns the checkpoint and
    notes for the user (e.g. that `latest` named an incomplete checkpoint and an older one is used)."""
    notes: list[str] = []
    if spec == "latest":
        directory = run_dir / CHECKPOINTS
    else:
        path = Path(spec)
        if not path.exists() and (run_dir / CHECKPOINTS / spec).is_dir():
            path = run_dir / CHECKPOINTS / spec  # a bare tag name
        if not path.exists():
            raise UserError.single(f"no such checkpoint: {spec}", "--resume",
                                   "give 'latest', a run directory, its checkpoints/ directory or one tag directory")
        if (path / COMPLETE_MARK).exists() or _step_of(path) is not None:
            found = verify(path)
            if found is None:
                raise UserError.single("this checkpoint is incomplete (no completion mark, or rank files missing)",
                                       f"--resume {spec}", "resume from another tag, or use --resume latest")
            return found, notes
        directory = path / CHECKPOINTS if (path / CHECKPOINTS).is_dir() else path
    complete = complete_checkpoints(directory)
    if not complete:
        raise UserError.single(f"no complete checkpoint in {directory}", "--resume",
                               "start without --resume, or point --resume at a run that saved a checkpoint")
    chosen = complete[-1]  # the last one saved; `latest` names it unless a kill came between the two
    latest_file = directory / LATEST
    named = latest_file.read_text().strip() if latest_file.is_file() else None
    if named and named != chosen.tag:
        if any(c.tag == named for c in complete):
            notes.append(f"'latest' names {named}, but {chosen.tag} was saved completely after it (the job "
                         f"ended before moving 'latest'); resuming from {chosen.tag}")
        else:
            notes.append(f"'latest' names {named}, which is not complete; resuming from {chosen.tag}, "
                         "the last complete checkpoint")
    complete_tags = {c.tag for c in complete}
    for child in sorted(directory.iterdir()):
        step = _step_of(child)
        if child.is_dir() and step is not None and step > chosen.step and child.name not in complete_tags | {named}:
            notes.append(f"{child.name} is incomplete (its save was interrupted) and is skipped")
    return chosen, notes
