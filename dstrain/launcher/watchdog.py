"""The hang watchdog of `dstrain run` / `dstrain eval`: reads the ranks' heartbeats (RUN_DIR/ranks/
rank<R>.beat, written by dstrain/rank/heartbeat.py), and when every live rank has been silent past
its allowance (rules in dstrain/hangs.py) names the stuck rank, its phase and its Python stack.

The stack comes from the rank itself: SIGUSR1 makes its faulthandler write every thread's stack to
RUN_DIR/ranks/rank<R>.stack. Ending the job is the supervisor's part (supervise.py).
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path
from typing import Callable

from rich.console import Console

from dstrain.checkpoints import LATEST
from dstrain.console_text import outside
from dstrain.hangs import Beat, Verdict, judge, read_beats, stack_file
from dstrain.rundir import CHECKPOINTS

CHECK_EVERY_S = 1.0
STACK_WAIT_S = 3.0


class Watchdog:
    def __init__(self, run_dir: Path, timeout_s: float, console: Console):
        self.run_dir = run_dir
        self.timeout_s = timeout_s
        self.console = console
        self.next_check = 0.0

    def hung(self, local_pids: Callable[[], dict[int, int]]) -> bool:
        """Check (at most every CHECK_EVERY_S); on a hang print the report and return True.
        `local_pids()`: rank -> pid of the live ranks this process may signal."""
        now = time.monotonic()
        if self.timeout_s <= 0 or now < self.next_check:
            return False
        self.next_check = now + CHECK_EVERY_S
        beats = read_beats(self.run_dir)
        verdict = judge(beats, time.time(), self.timeout_s)
        if verdict is None:
            return False
        # Only ranks whose heartbeat is up have the SIGUSR1 handler (without it the signal kills).
        ready = {rank: pid for rank, pid in local_pids().items() if rank in beats and beats[rank].pid == pid}
        stacks = dump_stacks(self.run_dir, ready)
        for line in report(verdict, stacks.get(verdict.stuck.rank), self.run_dir):
            self.console.print(line, soft_wrap=True, highlight=False)
        return True


def dump_stacks(run_dir: Path, local_pids: dict[int, int]) -> dict[int, str]:
    """Ask every local rank for its stacks (SIGUSR1) and collect what they write; rank -> text."""
    before = {}
    for rank, pid in local_pids.items():
        before[rank] = _size(stack_file(run_dir, rank))
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            before.pop(rank)
    # faulthandler writes the whole dump at once from its signal handler: once a file has grown,
    # a moment more lets the dump finish.
    deadline = time.monotonic() + STACK_WAIT_S
    while time.monotonic() < deadline and not all(_size(stack_file(run_dir, r)) > at for r, at in before.items()):
        time.sleep(0.1)
    time.sleep(0.2)
    return {rank: _read_from(stack_file(run_dir, rank), offset) for rank, offset in before.items()}


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _read_from(path: Path, offset: int) -> str:
    try:
        with open(path, errors="replace") as handle:
            handle.seek(offset)
            return handle.read()
    except OSError:
        return ""


def report(verdict: Verdict, stack: str | None, run_dir: Path) -> list[str]:
    """The lines the user sees: who is stuck where, who waits, the stack, what happens next (markup: the
    host names, paths and stack are escaped)."""
    stuck = verdict.stuck
    lines = [f"[bold red]hang:[/] rank {stuck.rank} made no progress for {verdict.idle_s:.0f} s "
             f"(limit {verdict.allowance_s:.0f} s, train.hang_timeout_s) in phase {stuck.phase}{_of_step(stuck)} "
             f"(pid {stuck.pid} on {outside(stuck.host)})"]
    for other in verdict.waiting:
        lines.append(f"  rank {other.rank}: in phase {other.phase}{_of_step(other)} for "
                     f"{time.time() - other.since:.0f} s (probably waiting for rank {stuck.rank})")
    if stack and stack.strip():
        lines.append(f"rank {stuck.rank}'s Python stack (most recent call first; every rank's in "
                     f"{outside(run_dir / 'ranks')}/rank*.stack):")
        lines += [outside("  " + line) for line in stack.rstrip().splitlines()]
    elif stuck.host != socket.gethostname():
        lines.append(f"rank {stuck.rank} runs on {outside(stuck.host)}: its stack is in "
                     f"{outside(stack_file(run_dir, stuck.rank))} "
                     "once that node's `dstrain run` asks for it")
    else:
        lines.append(f"rank {stuck.rank} wrote no stack (to {outside(stack_file(run_dir, stuck.rank))})")
    latest = _latest(run_dir)
    lines.append("ending the job; " + (f"the last complete checkpoint {outside(latest)} stays `latest` (continue with "
                                       "--resume latest)" if latest else "no checkpoint was saved"))
    return lines


def _of_step(beat: Beat) -> str:
    return f" of step {beat.step}" if beat.step is not None else ""


def _latest(run_dir: Path) -> str | None:
    try:
        return (run_dir / CHECKPOINTS / LATEST).read_text().strip() or None
    except OSError:
        return None
