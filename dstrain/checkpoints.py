"""Checkpoints on disk: their names, completion marks, `latest`, retention, and finding the one to resume.

Owns the on-disk layout that the launcher (resume checks), the ranks (saving, pruning) and the tools
(convert, eval) all read. Pure file-system code: it never imports torch or DeepSpeed; the rank-side
saving lives in dstrain/rank/checkpointing.py.

DeepSpeed writes each rank's shards with `engine.save_checkpoint`; dstrain adds per-rank RNG
states, then, once every rank has written (a barrier), rank 0 writes a completion mark listing
every file of the tag with its size and SHA-256 (hashed by the ranks, see `assign_files`), and
only then points `latest` at it (write-then-rename, so a kill at any moment leaves either the old
or the new pointer). Resuming takes the last checkpoint saved whose mark is there and whose files
are all present with the recorded sizes (hashes too on request), saying which newer one it
skipped and why. Marks of older dstrain versions list names only: those are checked for presence.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dstrain.errors import UserError
from dstrain.rundir import CHECKPOINTS

COMPLETE_MARK = "dstrain_complete.json"
LATEST = "latest"
HASH = "sha256"  # OpenSSL's uses the CPU's SHA instructions (x86 SHA-NI, ARMv8): ~1.7 GB/s a core; `sha256sum` agrees
_CHUNK = 1 << 20  # measured: 256 KiB-8 MiB hash alike (~1.55 GB/s here), 32 MiB is slower


def tag_for(step: int) -> str:
    return f"step{step:08d}"


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


# ---------------------------------------------------------------- file records (ranks write, everyone checks)

def record_file(path: Path, with_hash: bool) -> dict[str, Any]:
    """What the mark says of one file: its size, and its SHA-256 when `with_hash`."""
    if not with_hash:
        return {"size": path.stat().st_size}
    digest, size = hashlib.sha256(), 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while count := handle.readinto(buffer):
            digest.update(view[:count])  # releases the GIL: threads hash in parallel
            size += count
    return {"size": size, HASH: digest.hexdigest()}


_WRITER = re.compile(r"(?:zero_pp_rank_|rng_rank)(\d+)")


def assign_files(listings: list[dict[str, int]]) -> list[list[str]]:
    """Which rank records (hashes) which file of a tag, from each rank's view {name: size} of it.

    A file goes to a rank that sees it (nodes without a shared file system see only their own), to
    the rank that wrote it where the name says so (zero_pp_rank_R..., rng_rankR: still in its page
    cache), otherwise to the least loaded rank that sees it, biggest files first."""
    load = [0] * len(listings)
    assigned: list[list[str]] = [[] for _ in listings]
    sizes = {name: size for listing in listings for name, size in listing.items()}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        seers = [rank for rank, listing in enumerate(listings) if name in listing]
        writer = _WRITER.search(name)
        if writer and int(writer.group(1)) in seers:
            rank = int(writer.group(1))
        else:
            rank = min(seers, key=lambda r: load[r])
        assigned[rank].append(name)
        load[rank] += sizes[name]
    return assigned


def listed_files(mark: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The mark's files as {name: record}; marks of dstrain before sizes were recorded list names only."""
    files = mark["files"]
    if isinstance(files, list) and all(isinstance(name, str) for name in files):
        return {name: {} for name in files}
    if isinstance(files, dict) and all(isinstance(r, dict) and isinstance(r.get("size", 0), int)
                                       for r in files.values()):
        return files
    raise ValueError("'files' is neither a list of names nor a map of file records")


def file_damage(path: Path, record: dict[str, Any], with_hash: bool) -> str | None:
    """What is wrong with one listed file (None: it is as the mark recorded it)."""
    if not path.is_file():
        return "missing"
    size, expected = path.stat().st_size, record.get("size")
    if expected is not None and size != expected:
        return f"{'truncated' if size < expected else 'grown'}: {size} bytes, the mark recorded {expected}"
    if with_hash and HASH in record and record_file(path, with_hash=True)[HASH] != record[HASH]:
        return "changed: its SHA-256 differs from the one recorded when it was saved"
    return None


# ---------------------------------------------------------------- checking and finding (launcher, ranks, tools)

def _step_of(tag_dir: Path) -> int | None:
    name = tag_dir.name
    return int(name[4:]) if name.startswith("step") and name[4:].isdigit() else None


@dataclass
class TagCheck:
    """One tag directory checked against its completion mark."""

    tag_dir: Path
    found: CompleteCheckpoint | None = None  # set when the mark is there and readable
    damaged: dict[str, str] = field(default_factory=dict)  # file name -> what is wrong with it
    hashed: bool = False  # SHA-256 compared (the mark records hashes and they were asked for)
    sized: bool = False  # the mark records sizes (dstrain before this did not)

    @property
    def intact(self) -> bool:
        return self.found is not None and not self.damaged

    def damage_line(self) -> str:
        """The damage in one line: 'a.pt truncated: 10 bytes, the mark recorded 20; b.pt missing'."""
        if self.found is None:
            return "no completion mark (its save was interrupted, or dstrain did not write it)"
        return "; ".join(f"{name} {problem}" for name, problem in self.damaged.items())


def check_tag(tag_dir: Path, hashes: bool = False) -> TagCheck:
    """Check a tag directory: its mark, every listed file's presence and size, and with `hashes` its SHA-256
    (files hashed in parallel threads)."""
    check = TagCheck(tag_dir)
    try:
        mark = json.loads((tag_dir / COMPLETE_MARK).read_text())
        step, world_size, saved_at = int(mark["step"]), int(mark["world_size"]), mark["time"]
        files = listed_files(mark)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):  # unreadable, or not a mark dstrain wrote
        return check
    if not isinstance(saved_at, (int, float)):
        return check
    check.found = CompleteCheckpoint(tag_dir.parent, tag_dir.name, step, world_size, mark)
    check.sized = all("size" in record for record in files.values())
    check.hashed = hashes and all(HASH in record for record in files.values())
    names = sorted(files)

    def damage(name: str) -> str | None:
        return file_damage(tag_dir / name, files[name], check.hashed)

    if check.hashed and len(names) > 1:
        with ThreadPoolExecutor(min(len(names), os.cpu_count() or 1, 8)) as pool:
            problems = list(pool.map(damage, names))
    else:
        problems = [damage(name) for name in names]
    check.damaged = {name: problem for name, problem in zip(names, problems) if problem}
    return check


def verify(tag_dir: Path) -> CompleteCheckpoint | None:
    """The checkpoint in `tag_dir` if its completion mark exists and every file it lists is there with
    the recorded size."""
    check = check_tag(tag_dir)
    return check.found if check.intact else None


def tag_dirs(directory: Path) -> list[Path]:
    """The subdirectories of a checkpoints directory that are (or were being written as) tags."""
    if not directory.is_dir():
        return []
    return sorted(child for child in directory.iterdir() if child.is_dir() and
                  ((child / COMPLETE_MARK).exists() or _step_of(child) is not None
                   or any(child.glob("*_states.pt"))))


def _by_save_time(checks: list[TagCheck]) -> list[TagCheck]:
    """Oldest saved first: a run rewound with --resume <older tag> saves lower steps after higher ones."""
    return sorted((c for c in checks if c.found), key=lambda c: (c.found.mark["time"], c.found.step))


def complete_checkpoints(directory: Path) -> list[CompleteCheckpoint]:
    """Complete, intact (sizes) checkpoints under a checkpoints directory, in the order they were saved."""
    return [c.found for c in _by_save_time([check_tag(d) for d in tag_dirs(directory)]) if c.intact]


def find_resume(spec: str, run_dir: Path, hashes: bool = False) -> tuple[CompleteCheckpoint, list[str]]:
    """Resolve --resume (latest, a run dir, a checkpoints dir or a tag dir). Returns the newest intact
    checkpoint (sizes checked; SHA-256 too with `hashes`) and notes for the user (e.g. that `latest`
    named a damaged or incomplete checkpoint and an older one is used). A named tag must be intact."""
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
            return _named_tag(path, spec, hashes), []
        directory = path / CHECKPOINTS if (path / CHECKPOINTS).is_dir() else path
    checks = [check_tag(d) for d in tag_dirs(directory)]
    chosen, damaged = _newest_intact(_by_save_time(checks), hashes)
    if chosen is None:
        raise UserError.single(f"no complete checkpoint in {directory}", "--resume",
                               "start without --resume, or point --resume at a run that saved a checkpoint")
    return chosen, _skipped_notes(directory, checks, chosen, damaged)


def _newest_intact(saved: list[TagCheck], hashes: bool) -> tuple[CompleteCheckpoint | None, list[TagCheck]]:
    """The last intact checkpoint saved, and the marked ones saved after it that are damaged."""
    damaged = []
    for check in reversed(saved):
        if check.intact and hashes:
            check = check_tag(check.tag_dir, hashes=True)
        if check.intact:
            return check.found, damaged
        damaged.append(check)
    return None, damaged


def _skipped_notes(directory: Path, checks: list[TagCheck], chosen: CompleteCheckpoint,
                   damaged: list[TagCheck]) -> list[str]:
    notes = []
    latest_file = directory / LATEST
    named = latest_file.read_text().strip() if latest_file.is_file() else None
    intact_tags = {c.tag_dir.name for c in checks if c.intact} - {c.tag_dir.name for c in damaged}
    for check in damaged:  # newest first
        tag = check.tag_dir.name
        if tag == named:
            notes.append(f"'latest' names {tag}, which is damaged ({check.damage_line()}); resuming from "
                         f"{chosen.tag}, the newest intact checkpoint")
        else:
            notes.append(f"{tag} is damaged ({check.damage_line()}) and is skipped")
    if named and named != chosen.tag and named not in {c.tag_dir.name for c in damaged}:
        if named in intact_tags:
            notes.append(f"'latest' names {named}, but {chosen.tag} was saved completely after it (the job "
                         f"ended before moving 'latest'); resuming from {chosen.tag}")
        else:
            notes.append(f"'latest' names {named}, which is not complete; resuming from {chosen.tag}, "
                         "the last complete checkpoint")
    for check in checks:
        step = _step_of(check.tag_dir)
        if check.found is None and step is not None and step > chosen.step and check.tag_dir.name != named:
            notes.append(f"{check.tag_dir.name} is incomplete (its save was interrupted) and is skipped")
    return notes


def _named_tag(path: Path, spec: str, hashes: bool) -> CompleteCheckpoint:
    """The tag directory --resume names, if intact; otherwise exit 2 naming the damage and the intact tags."""
    check = check_tag(path, hashes)
    if check.intact:
        return check.found
    intact = [c.tag for c in complete_checkpoints(path.parent)]
    others = (f"intact tags here: {', '.join(intact)}; " if intact else "no intact tag here; ") + \
        "--resume latest takes the newest intact one"
    if check.found is None:
        raise UserError.single("this checkpoint is incomplete (no completion mark: its save was interrupted)",
                               f"--resume {spec}", f"resume from another tag ({others})")
    raise UserError.single(f"checkpoint {path.name} is damaged: {check.damage_line()}", f"--resume {spec}",
                           f"resume from another tag ({others}); `dstrain checkpoint verify {path.parent}` "
                           "checks them all")


def find_resume_auto(run_dir: Path, hashes: bool = False) -> tuple[CompleteCheckpoint | None, list[str]]:
    """--resume auto: what --resume latest would take, or None (start fresh) while the run directory
    holds no complete checkpoint, so a requeue loop can run the same command every time."""
    if not complete_checkpoints(run_dir / CHECKPOINTS):
        return None, [f"--resume auto: no complete checkpoint in {run_dir / CHECKPOINTS} yet; starting fresh"]
    return find_resume("latest", run_dir, hashes=hashes)
