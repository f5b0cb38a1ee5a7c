"""`dstrain checkpoint verify DIR`: check checkpoints against their completion marks and say which
are safe to resume from or convert.

DIR is a run directory, its checkpoints/ directory or one tag directory. Every listed file must be
present with the size and SHA-256 the mark recorded when it was saved (dstrain/checkpoints.py owns
the marks and the checks). Exit 0 when the target is intact; 2 (the code of every refused input)
when it is damaged or incomplete, or for a directory when any marked tag in it is damaged or none is
intact. Reads bytes only: no torch, no DeepSpeed.
"""

from __future__ import annotations

from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from dstrain.checkpoints import COMPLETE_MARK, HASH, LATEST, TagCheck, check_tag, listed_files, tag_dirs
from dstrain.console_text import outside
from dstrain.errors import EXIT_BAD_INPUT, UserError
from dstrain.rundir import CHECKPOINTS


def verify_checkpoints(target: Path, hashes: bool = True, console: Console | None = None) -> int:
    """Check every tag under `target` (or `target` itself when it is a tag), print a table; the exit code."""
    console = console or Console(highlight=False)
    directory, dirs = _tag_dirs_of(target)
    checks = [check_tag(d, hashes) for d in dirs]
    console.print(_table(checks, directory))
    for check in checks:
        if check.found is not None:
            for name, problem in check.damaged.items():
                console.print(f"[red]damaged:[/] {outside(check.tag_dir / name)} {outside(problem)}", soft_wrap=True)
    if directory is None:
        return _single_verdict(checks[0], console)
    return _directory_verdict(checks, directory, console)


def _directory_verdict(checks: list[TagCheck], directory: Path, console: Console) -> int:
    damaged = [c for c in checks if c.found is not None and c.damaged]
    intact = [c for c in checks if c.intact]
    if intact:
        latest = directory / LATEST
        named = latest.read_text().strip() if latest.is_file() else None
        newest = max(intact, key=lambda c: (c.found.mark["time"], c.found.step)).tag_dir.name
        aside = f" ('latest' names {outside(named)})" if named and named != newest else ""
        console.print(f"newest intact tag: {outside(newest)}{aside}")
    if damaged:
        console.print(f"[bold red]not intact:[/] {len(damaged)} damaged, {len(intact)} intact tag(s) in "
                      f"{outside(directory)}; resume from an intact tag (--resume latest skips damaged ones) "
                      "and delete or restore the damaged ones from a copy", soft_wrap=True)
        return EXIT_BAD_INPUT
    if not intact:
        console.print(f"[bold red]no intact checkpoint[/] in {outside(directory)}: no tag has a completion mark "
                      "(saves interrupted, or not written by dstrain)", soft_wrap=True)
        return EXIT_BAD_INPUT
    return 0


def _single_verdict(check: TagCheck, console: Console) -> int:
    if check.intact:
        checked = {"presence": "files present; its mark, from an older dstrain, records no sizes",
                   "size": "sizes match; no hashes compared"}.get(_checked(check), "sizes and SHA-256 match")
        console.print(f"{outside(check.tag_dir)}: intact ({checked}): safe to resume from or convert", soft_wrap=True)
        return 0
    others = [c.tag for c in _intact_siblings(check.tag_dir)]
    where = f"intact tags beside it: {outside(', '.join(others))}" if others else "no intact tag beside it"
    verdict = "not safe to resume from or convert" if check.found else "cannot be verified"
    console.print(f"[bold red]{outside(check.tag_dir)}: {verdict}:[/] {outside(check.damage_line())}; {where}",
                  soft_wrap=True)
    return EXIT_BAD_INPUT


def _intact_siblings(tag_dir: Path):
    return [c.found for c in (check_tag(d) for d in tag_dirs(tag_dir.parent) if d != tag_dir) if c.intact]


def _tag_dirs_of(target: Path) -> tuple[Path | None, list[Path]]:
    """(the checkpoints directory, its tag directories), or (None, [target]) for one tag directory."""
    if not target.is_dir():
        raise UserError.single("no such directory", str(target),
                               "give a run directory, its checkpoints/ directory or one tag directory")
    if (target / COMPLETE_MARK).exists() or any(target.glob("*_states.pt")):
        return None, [target]
    directory = target / CHECKPOINTS if (target / CHECKPOINTS).is_dir() else target
    dirs = tag_dirs(directory)
    if not dirs:
        raise UserError.single("holds no checkpoint (no tag directory with a completion mark or DeepSpeed files)",
                               str(target), "give a run directory, its checkpoints/ directory or one tag directory")
    return directory, dirs


def _table(checks: list[TagCheck], directory: Path | None) -> Table:
    # A str title or cell is read as markup: the directory and the tags' names are escaped.
    table = Table(title=f"checkpoints in {outside(directory)}" if directory else None, title_justify="left",
                  box=box.SIMPLE_HEAD)
    table.add_column("tag", no_wrap=True)
    for column in ("step", "files", "size"):
        table.add_column(column, justify="right", no_wrap=True)
    table.add_column("checked", no_wrap=True)
    table.add_column("status")
    for check in checks:
        table.add_row(*_row(check))
    return table


def _row(check: TagCheck) -> tuple[str, ...]:
    name = outside(check.tag_dir.name)
    if check.found is None:
        return name, "", "", "", "", "[yellow]incomplete: no mark[/]"
    records = listed_files(check.found.mark)
    size = _size(sum(r.get("size", 0) for r in records.values())) if check.sized else "?"
    status = "[green]intact: resume, convert[/]" if check.intact else "[red]damaged: do not use[/]"
    return name, str(check.found.step), str(len(records)), size, _checked(check), status


def _checked(check: TagCheck) -> str:
    """What was compared with the mark: sha256, size (no hashes recorded, or --no-hashes), presence (old mark)."""
    return HASH if check.hashed else "size" if check.sized else "presence"


def _size(count: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return str(count)
