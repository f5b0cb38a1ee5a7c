"""Starting the ranks while `dstrain run` still checks.

Every process in the chain imports torch and DeepSpeed, seconds each: the `dstrain` command for its
checks, DeepSpeed's per-node launcher, then each rank. On one node the launcher and the ranks start
as soon as the config resolves, and their imports run beside the checks; the ranks then wait at a
gate (rundir.START_GATE_ENV) until every check has passed and the run directory is written. A check
that fails, Ctrl-C or SIGTERM kills them before they have touched anything: bad input still costs no
GPU allocation and writes nothing.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

from dstrain.launcher.supervise import start_launcher
from dstrain.rundir import START_GATE_ENV, write_atomic
from dstrain.switches import switch


class EarlyStart:
    """DeepSpeed's launcher with its ranks held at the gate. `open()` lets them train, `cancel()`
    kills them; `process` goes to supervise() once the gate is open."""

    def __init__(self, command: list[str], env: dict[str, str]):
        self.folder = Path(tempfile.mkdtemp(prefix="dstrain-start-"))
        self.gate = self.folder / "gate"
        self.process: subprocess.Popen | None = None
        # Ctrl-C or SIGTERM while the checks run ends the job here, ranks first. Not by raising in
        # the checks: an exception inside an import (torch's, DeepSpeed's) can leave it half done.
        self._previous = {s: signal.signal(s, self._stop) for s in (signal.SIGINT, signal.SIGTERM)}
        self.process = start_launcher(command, {**env, START_GATE_ENV: f"{os.getpid()}:{self.gate}"})

    def open(self) -> subprocess.Popen:
        """Let the ranks go (the run directory is written); supervise() takes over the signals."""
        self._restore_signals()
        write_atomic(self.gate, "go")
        assert self.process is not None
        return self.process

    def cancel(self) -> None:
        """Kill the launcher and its ranks (still at the gate: they have written nothing)."""
        self._restore_signals()
        if self.process is None:  # stopped before the launcher started
            self.remove()
            return
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait()
        self.remove()

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

    def _restore_signals(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _stop(self, signum, _frame) -> None:
        self.cancel()
        print(f"\n{signal.Signals(signum).name}: stopped before training started", flush=True)
        os._exit(128 + signum)


def wanted(ds_config: dict) -> bool:
    """DSTRAIN_EARLY_START: 0/off turns it off (for debugging a start-up: everything then runs in order),
    1/on turns it on. Unset: on, except for ZeRO-3 jobs. Their 1.3B rows on one H100 trained a median 6.7%
    slower with it (docs/benchmarks.md, finding 27; -4.9% in four more pairs, finding 33; the rank's own
    early imports are not the cause, the cause is not found), and there it saved 2-3 s of start-up."""
    setting = switch(os.environ, "DSTRAIN_EARLY_START")
    if setting is not None:
        return setting
    zero = ds_config.get("zero_optimization")
    return not (isinstance(zero, dict) and zero.get("stage") == 3)
