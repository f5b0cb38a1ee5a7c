"""This rank's heartbeat: its phase and step in RUN_DIR/ranks/rank<R>.beat, and its Python stack on
SIGUSR1 (faulthandler, every thread) in rank<R>.stack, for the supervisor's hang watchdog.

`beat(phase, step)` only stores the values and the time (no I/O, no device sync: it sits on the
train loop's hot path); a daemon thread writes the file at most WRITE_EVERY_S apart when it changed,
and every ALIVE_EVERY_S even when it did not: that write is the rank's sign of life, which a long
compile or a slow step does not hold up (they release the GIL often), but a stopped process or a
frozen host does. The progress time recorded is that of the call, so a rank that blocks right after a
report is judged from it even if the thread goes on writing. One heartbeat per process: `start` once,
early in the rank.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
import threading
import time
from pathlib import Path

from dstrain.hangs import ALIVE_EVERY_S, DONE, Beat, beat_file, stack_file

WRITE_EVERY_S = 0.25


class Heartbeat:
    def __init__(self, run_dir: Path, rank: int):
        self.path = beat_file(run_dir, rank)
        self.state = Beat(rank, os.getpid(), socket.gethostname(), "startup", None, None, time.time())
        self.version = 0
        self.written = -1
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="dstrain-heartbeat", daemon=True)

    def beat(self, phase: str, step: int | None = None) -> None:
        state = self.state
        state.phase, state.since = phase, time.time()
        if step is not None:
            if state.first_step is None and phase != "startup":
                state.first_step = step
            state.step = step
        self.version += 1

    def write(self) -> None:
        version = self.version
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        self.state.alive = time.time()
        try:
            tmp.write_text(self.state.to_json())
            os.replace(tmp, self.path)  # the supervisor reads whole records only
        except OSError:
            return  # a full disk must not kill training; the watchdog then sees an old record
        self.written = version

    def _run(self) -> None:
        last = time.monotonic()
        while not self.stop.wait(WRITE_EVERY_S):
            if self.version != self.written or time.monotonic() - last >= ALIVE_EVERY_S:
                self.write()
                last = time.monotonic()


_current: Heartbeat | None = None
_stack_handle = None


def start(run_dir: Path, rank: int) -> None:
    """Register the stack dump, write the first report ("startup") and start the writer thread."""
    global _current, _stack_handle
    _stack_handle = open(stack_file(run_dir, rank), "w")  # kept open: faulthandler writes to its fd
    faulthandler.register(signal.SIGUSR1, file=_stack_handle, all_threads=True, chain=False)
    _current = Heartbeat(run_dir, rank)
    _current.write()  # before the pid is useful to the supervisor: SIGUSR1 is handled from here on
    _current.thread.start()


def beat(phase: str, step: int | None = None) -> None:
    """Report progress: now in `phase` (of `step`, if given). Does nothing before `start`."""
    if _current is not None:
        _current.beat(phase, step)


def finish() -> None:
    """The last report: this rank is done (the watchdog no longer waits for it)."""
    if _current is None:
        return
    _current.stop.set()
    _current.beat(DONE)
    _current.write()
