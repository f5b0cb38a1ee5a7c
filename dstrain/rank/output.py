"""Where a rank's output goes: the console for what a user acts on, RUN_DIR/ranks/rank<R>.log for the rest.

The log gets everything the rank writes to stderr (warnings, dstrain's notes, a failure's full traceback)
and the known third-party lines below; the console gets the same, less those known lines and less the
traceback (`dstrain run` prints one message for a failed run, pointing at this log). With --verbose the
console gets everything, as before. stdout is not copied to the log: rank 0's live progress bar is there.

Installed first thing in the rank, before torch and DeepSpeed are imported (DeepSpeed's logger keeps the
stdout it finds at import). The log opens once the run directory is known to exist (a rank started early
waits at the start gate before `dstrain run` has written it); lines written before are kept until then.
"""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path

from dstrain import rundir

# Third-party lines every run printed and no user acts on (issue 38), each with where it comes from:
KNOWN_NOISE = re.compile("|".join((
    r"DeepSpeed \S+ built successfully",  # deepspeed/comm/torch.py prints it after a JIT op load, every run
    r"get learning rate from scheduler before it has started",  # lr_schedules.py, on the first log line
    r"Full backward hook is firing when gradients are computed",  # torch hooks under ZeRO-3's module hooks
    r"`is_gradient_checkpointing` is deprecated",  # transformers 5: FutureWarning from a property read
    r"Setting accelerator to CPU",  # DeepSpeed's import on CPU ranks
    r"all_gather_into_tensor|reduce_scatter_tensor",  # torch.distributed's deprecation of DeepSpeed's calls
)))


class _Stream(io.TextIOBase):
    """A text stream that writes to the console stream it replaced and, for stderr, to the rank log."""

    def __init__(self, console, router: "_Router", to_log: bool):
        self.console, self.router, self.to_log = console, router, to_log
        self._swallow_newline = False

    def write(self, text: str) -> int:
        if self.to_log:
            self.router.log(text)
        noise = self.router.quiet and bool(KNOWN_NOISE.search(text))
        if noise and not self.to_log:
            self.router.log(text + ("" if text.endswith("\n") else "\n"))
        if noise or (self._swallow_newline and text == "\n"):
            self._swallow_newline = noise and not text.endswith("\n")  # print() writes the newline apart
            return len(text)
        self._swallow_newline = False
        return self.console.write(text)

    def flush(self) -> None:
        self.console.flush()
        self.router.flush()

    def isatty(self) -> bool:
        return self.console.isatty()

    def fileno(self) -> int:
        return self.console.fileno()

    @property
    def encoding(self):  # type: ignore[override]
        return getattr(self.console, "encoding", "utf-8")


class _Router:
    def __init__(self) -> None:
        self.quiet = True  # until launch.json says --verbose
        self.path: Path | None = None
        self._file = None
        self._pending: list[str] = []

    def log(self, text: str) -> None:
        if self._file is not None:
            self._file.write(text)
        elif len(self._pending) < 10_000:
            self._pending.append(text)

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def open(self, path: Path) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", buffering=1, encoding="utf-8", errors="replace")
        except OSError:
            return  # best effort: the console still has the output
        self.path = path
        self._file.write("".join(self._pending))
        self._pending.clear()


_router = _Router()


def install() -> None:
    """Route this process's stdout and stderr (call once, before importing torch or DeepSpeed)."""
    if isinstance(sys.stderr, _Stream):
        return
    sys.stdout = _Stream(sys.stdout, _router, to_log=False)
    sys.stderr = _Stream(sys.stderr, _router, to_log=True)


def open_log(run_dir: Path, rank: int, verbose: bool) -> None:
    """Start writing RUN_DIR/ranks/rank<R>.log; `verbose` (--verbose) shows the known noise again."""
    _router.quiet = not verbose
    if _router.path is None:
        _router.open(rundir.rank_log(run_dir, rank))


def write_log_only(text: str) -> None:
    """Into the rank log and not the console (a failure's traceback), unless --verbose: then both."""
    if not _router.quiet and isinstance(sys.stderr, _Stream):
        sys.stderr.write(text)
        return
    _router.log(text)
    _router.flush()
