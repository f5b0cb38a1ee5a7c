"""Saving and loading checkpoints from inside the ranks: DeepSpeed's shards, per-rank RNG states, then each
file's size and SHA-256 (every rank hashes its share while the files are in its page cache), then
the completion mark and `latest` (rank 0, after a barrier), then pruning; loading one back (resume, rollback).

The layout it writes and the reading side (marks, `latest`, resume) are dstrain/checkpoints.py.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from dstrain.checkpoints import (COMPLETE_MARK, LATEST, assign_files, complete_checkpoints, prune, record_file,
                                 tag_for)
from dstrain.errors import UserError
from dstrain.rank import heartbeat
from dstrain.rank.cadence import SaveClock
from dstrain.rundir import CHECKPOINTS, LaunchInfo, write_atomic


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


def load(engine, directory: str | Path, tag: str, rank: int, world: int) -> dict[str, Any]:
    """Load one checkpoint into the engine (model, optimizer, scheduler, RNG); returns its client state.
    Used to resume (dstrain/rank/worker.py) and to roll back (dstrain/rank/health.py)."""
    import torch

    _, client = engine.load_checkpoint(str(directory), tag=tag, load_optimizer_states=True,
                                       load_lr_scheduler_states=True)
    if client is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {tag} from {directory}")
    rng_file = Path(directory) / tag / f"rng_rank{rank}.pt"
    if rng_file.exists() and client.get("world_size") == world:
        set_rng_state(torch.load(rng_file, weights_only=False))  # our own file: python/numpy states
    return client


def save(engine, run_dir: Path, step: int, client_state: dict[str, Any], keep_last: int,
         hashes: bool = True) -> Path:
    """Save a checkpoint on every rank, record its files (SHA-256 too with `hashes`), mark it complete,
    move `latest`, prune old ones."""
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
    files = _record_files(directory / tag, hashes, rank, world)
    if rank == 0:
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


class Checkpointer:
    """Saves the run's checkpoints and decides when: every train.save_every steps, at the last step, at a
    stop, when the save clock (train.save_every_minutes) is due on any rank, and at an early stop; never
    with train.save_checkpoints false. Each checkpoint carries `client_state(step)` beside DeepSpeed's."""

    def __init__(self, engine, run_dir: Path, train_config, client_state: Callable[[int], dict[str, Any]]):
        self.engine, self.run_dir, self.t, self.client_state = engine, run_dir, train_config, client_state
        self.clock = SaveClock(train_config.save_every_minutes)

    def clock_due(self) -> bool:
        """This rank's save clock; the loop agrees on it with the other ranks (any due: all save)."""
        return self.t.save_checkpoints and self.clock.due()

    def should_save(self, step: int, stopping: bool, clock_agreed: bool, early_stopped: bool = False) -> bool:
        t = self.t
        return t.save_checkpoints and (step % t.save_every == 0 or step == t.max_steps or stopping or clock_agreed
                                       or early_stopped)

    def save(self, step: int) -> Path:
        heartbeat.beat("save")
        saved = save(self.engine, self.run_dir, step, self.client_state(step), self.t.keep_last,
                     self.t.checkpoint_hashes)
        self.clock.saved()
        return saved


def _record_files(tag_dir: Path, hashes: bool, rank: int, world: int) -> dict[str, dict[str, Any]]:
    """{relative path: {"size", "sha256"}} of every file of the tag, on every rank: each rank lists what
    it sees, records its share (see assign_files), and the records are gathered."""
    import torch.distributed as dist
    seen = {str(p.relative_to(tag_dir)): p.stat().st_size for p in tag_dir.rglob("*") if p.is_file()}
    listings: list[Any] = [None] * world
    dist.all_gather_object(listings, seen)
    mine = {name: record_file(tag_dir / name, hashes) for name in assign_files(listings)[rank]}
    records: list[Any] = [None] * world
    dist.all_gather_object(records, mine)
    return dict(sorted((name, record) for share in records for name, record in share.items()))


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


def export_final(run_dir: Path, step: int, launch: LaunchInfo, how: bool | str = True, dtype: str = "fp32") -> None:
    """train.export_final: the final checkpoint as one safetensors file, ("hf") a Hugging Face model
    folder or ("peft") the LoRA adapters as a peft folder (rank 0, after the last save)."""
    from dstrain.tools.convert import convert_checkpoint
    if how == "peft":
        from dstrain.tools.convert.peft_folder import export_peft_folder
        export = export_peft_folder(run_dir / CHECKPOINTS, run_dir / "final_adapter", tag=tag_for(step), dtype=dtype,
                                    force=True)
        print(export.summary())
        return
    if how == "hf":
        from dstrain.tools.convert.hf_folder import export_hf_folder
        export = export_hf_folder(run_dir / CHECKPOINTS, run_dir / "final_hf", tag=tag_for(step), dtype=dtype,
                                  force=True)
        print(export.summary())
        return
    output = run_dir / "final.safetensors"
    convert_checkpoint(run_dir / CHECKPOINTS, output, tag=tag_for(step), force=True, dtype=dtype,
                       metadata={"config_hash": launch.config_hash})
    print(f"exported consolidated weights to {output}")
