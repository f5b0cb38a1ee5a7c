"""When a rank counts as hung: the timeout per accelerator, the longer allowance of slow phases, the
collective timeout derived from it, and the heartbeat record both sides read and write.

The record carries two clocks: `since` moves with progress (a phase or step: the hang watchdog's), `alive`
with every write of the beat's own thread (the node watch's, dstrain/launcher/nodes.py): a rank that
compiles for ten minutes is slow but alive; one whose record stops changing altogether is stopped,
frozen or gone.

A rank (dstrain/rank/heartbeat.py) reports its phase and step; the supervisor (dstrain/launcher/
watchdog.py) judges the reports with these rules. No torch here: both sides import it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from dstrain.rundir import RANKS

DEFAULT_TIMEOUT_S = {"cuda": 600.0, "cpu": 1800.0}  # CPU ranks step slowly and often share their cores
SLOW_FACTOR = 3  # start-up (imports, JIT builds, restore), the first step (compile) and checkpoint saves
SLOW_PHASES = ("startup", "save")
PHASES = ("startup", "data", "forward", "backward", "step", "log", "eval", "save")  # in the order of one step
DONE = "done"    # the rank's last report: it has finished (or failed, which the launcher reports)
COLLECTIVE_MARGIN_S = 60.0
ALIVE_EVERY_S = 2.0  # how often a rank's heartbeat thread rewrites its beat file even without progress


def hang_timeout_s(setting: float | str, accelerator: str) -> float:
    """train.hang_timeout_s in seconds: "auto" is the accelerator's default; 0 turns detection off."""
    return DEFAULT_TIMEOUT_S.get(accelerator, DEFAULT_TIMEOUT_S["cuda"]) if setting == "auto" else float(setting)


def collective_timeout_s(timeout_s: float) -> float | None:
    """NCCL/gloo timeout: past the longest allowance, so the watchdog (which names the rank and prints
    its stack) speaks first, yet a collective never waits forever if the watchdog is gone."""
    return SLOW_FACTOR * timeout_s + COLLECTIVE_MARGIN_S if timeout_s > 0 else None


@dataclass
class Beat:
    """One rank's last report (RUN_DIR/ranks/rank<R>.beat)."""

    rank: int
    pid: int
    host: str
    phase: str          # startup, data, forward, backward, step, log, eval, save, done
    step: int | None    # the optimizer step being computed (1-based), or just completed for log/eval/save
    first_step: int | None  # the first step this process computes (slow: compile, allocator warm-up)
    since: float        # wall time of the last progress report
    alive: float = 0.0  # wall time of the last write: the beat's own thread writes at least every ALIVE_EVERY_S,
                        # progress or not, so a rank busy in a long compile or step still shows it lives

    def allowance_s(self, timeout_s: float) -> float:
        slow = self.phase in SLOW_PHASES or self.step is None or self.step == self.first_step
        return timeout_s * (SLOW_FACTOR if slow else 1)

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def beat_file(run_dir: Path, rank: int) -> Path:
    return run_dir / RANKS / f"rank{rank}.beat"


def stack_file(run_dir: Path, rank: int) -> Path:
    """Where the rank's faulthandler writes every thread's Python stack on SIGUSR1."""
    return run_dir / RANKS / f"rank{rank}.stack"


def read_beats(run_dir: Path) -> dict[int, Beat]:
    """rank -> its last report; a file being replaced or damaged is skipped this time."""
    beats = {}
    for path in (run_dir / RANKS).glob("rank*.beat"):
        try:
            beat = Beat(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue
        beats[beat.rank] = beat
    return beats


@dataclass
class Verdict:
    stuck: Beat             # the rank furthest behind: the likely cause
    waiting: list[Beat]     # the other live ranks (usually waiting for it in a collective)
    idle_s: float           # how long the stuck rank has made no progress
    allowance_s: float


def judge(beats: dict[int, Beat], now: float, timeout_s: float) -> Verdict | None:
    """A hang: every live rank has made no progress for longer than its allowance (in synchronous
    training one stuck rank soon holds all the others in a collective; one slow phase, such as rank 0
    saving while the others wait, is not a hang). The stuck rank is the one furthest behind: lowest
    step, then earliest phase of it (the others went on to the collective that waits for it), then
    silent the longest."""
    if timeout_s <= 0:
        return None
    live = [b for b in beats.values() if b.phase != DONE]
    if not live or any(now - b.since <= b.allowance_s(timeout_s) for b in live):
        return None
    stuck = min(live, key=lambda b: (b.step if b.step is not None else -1, _phase_order(b.phase), b.since))
    waiting = sorted((b for b in live if b is not stuck), key=lambda b: b.rank)
    return Verdict(stuck, waiting, now - stuck.since, stuck.allowance_s(timeout_s))


def _phase_order(phase: str) -> int:
    return PHASES.index(phase) if phase in PHASES else len(PHASES)
