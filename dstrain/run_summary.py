"""A run in a few numbers, read back from its metrics.jsonl: what `dstrain run` prints when the ranks end
and what `dstrain report` tabulates. Also the commands to type next, with the run's own paths.

Pure file reading: it imports neither torch nor DeepSpeed (the report and the launcher use it).
A run directory's metrics.jsonl holds every session of the run (a resume appends); a session starts
with a {"event": "run_start"} row and ends with {"event": "run_end"} (dstrain/rank/metrics.py).
"""

from __future__ import annotations

import json
import math
import shlex
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dstrain import rundir
from dstrain.checkpoints import complete_checkpoints
from dstrain.errors import UserError


def load_records(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of RUN_DIR/metrics.jsonl; UserError (exit 2) when the directory or file is missing. A
    torn last line (a run killed mid-write) is skipped."""
    if not run_dir.is_dir():
        raise UserError.single("no such run directory", str(run_dir), "give the --run-dir of a `dstrain run`")
    path = run_dir / rundir.METRICS
    if not path.is_file():
        raise UserError.single(f"no {rundir.METRICS} here: not a run directory, or its run logged no step yet",
                               str(run_dir), "give the --run-dir of a `dstrain run` that trained at least one step")
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            records.append(row)
    return records


def train_rows(records: list[dict]) -> list[dict]:
    return [r for r in records if "event" not in r and "loss" in r]


def eval_rows(records: list[dict]) -> list[dict]:
    return [r for r in records if "event" not in r and "eval_loss" in r]


SESSION_EVENTS = ("run_start", "run_end")  # bookkeeping rows, not things that happened to the model


def events(records: list[dict], kind: str | None = None) -> list[dict]:
    return [r for r in records if "event" in r and (kind is None or r["event"] == kind)]


def describe_event(event: dict) -> str:
    """{"event": "rollback", "step": 50, "to_step": 40, "time": ...} -> "rollback at step 50: to_step=40"."""
    fields = ", ".join(f"{k}={v}" for k, v in event.items() if k not in ("event", "step", "time"))
    return f"{event['event']} at step {event['step']}" + (f": {fields}" if fields else "")


def last_session(records: list[dict]) -> list[dict]:
    """The rows of the last session (from the last run_start on); all rows for files without one."""
    starts = [i for i, r in enumerate(records) if r.get("event") == "run_start"]
    return records[starts[-1]:] if starts else records


@dataclass
class RunSummary:
    run_dir: Path
    first_step: int | None  # where the summarised session started (0, or the step it resumed at)
    last_step: int | None
    max_steps: int | None
    train_seconds: float | None  # from the session's start to its last row
    tokens_per_s: float | None  # median over the session's log intervals
    mfu: float | None  # median; None on CPU or for a GPU without a known peak
    final_loss: float | None
    final_eval_loss: float | None
    rollbacks: int  # "rollback" events over the whole run
    events: int  # all other events (not run_start/run_end) over the whole run
    last_checkpoint: Path | None  # the last complete checkpoint on disk
    stopped_by: str | None


def _median(values: list[float]) -> float | None:
    finite = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return statistics.median(finite) if finite else None


def summarize(run_dir: Path, records: list[dict] | None = None) -> RunSummary:
    """The last session of a run (steps, time, speed, losses) and the whole run's events and checkpoint."""
    records = load_records(run_dir) if records is None else records
    session = last_session(records)
    trains, evals = train_rows(session), eval_rows(session)
    start = next((r for r in session if r.get("event") == "run_start"), None)
    end = next((r for r in reversed(session) if r.get("event") == "run_end"), None)
    times = [r["time"] for r in session if isinstance(r.get("time"), (int, float))]
    checkpoints = complete_checkpoints(run_dir / rundir.CHECKPOINTS)
    steps = [r["step"] for r in session]
    return RunSummary(
        run_dir=run_dir,
        first_step=start["step"] if start else (steps[0] if steps else None),
        last_step=steps[-1] if steps else None,
        max_steps=start.get("max_steps") if start else None,
        train_seconds=(times[-1] - times[0]) if len(times) > 1 else None,
        tokens_per_s=_median([r.get("tokens_per_s") for r in trains]),
        mfu=_median([r["mfu"] for r in trains if "mfu" in r]),
        final_loss=trains[-1]["loss"] if trains else None,
        final_eval_loss=evals[-1]["eval_loss"] if evals else None,
        rollbacks=len(events(records, "rollback")),
        events=len([e for e in events(records) if e["event"] not in SESSION_EVENTS]),
        last_checkpoint=checkpoints[-1].path if checkpoints else None,
        stopped_by=end.get("stopped_by") if end else None,
    )


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m{rest % 60:02d}s" if hours else f"{rest // 60}m{rest % 60:02d}s"


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def summary_lines(s: RunSummary, wall_seconds: float | None = None) -> list[str]:
    """What `dstrain run` prints when the ranks end."""
    steps = f"steps {s.first_step}-{s.last_step}" if s.first_step else f"{s.last_step} steps"
    wall = f"wall time {duration(wall_seconds)} (training {duration(s.train_seconds)})" if wall_seconds \
        else f"training time {duration(s.train_seconds)}"
    speed = f"median {fmt(s.tokens_per_s, ',.0f')} tokens/s" + (f", MFU {s.mfu:.1%}" if s.mfu is not None else "")
    losses = f"final loss {fmt(s.final_loss, '.4f')}, eval loss {fmt(s.final_eval_loss, '.4f')}"
    lines = [f"summary: {steps}, {wall}; {speed}; {losses}; rollbacks {s.rollbacks}"]
    lines.append(f"last complete checkpoint: {s.last_checkpoint}" if s.last_checkpoint
                 else "no complete checkpoint saved")
    return lines


def next_commands(s: RunSummary, accelerator: str | None = None) -> list[str]:
    """The commands to type next, with this run's paths (eval and convert only with a checkpoint)."""
    run = shlex.quote(str(s.run_dir))
    commands = []
    if s.last_checkpoint is not None:
        cpu = " --accelerator cpu" if accelerator == "cpu" else ""
        commands.append(f"dstrain eval --run-dir {run}{cpu}")
        commands.append(f"dstrain convert-checkpoint {shlex.quote(str(s.run_dir / rundir.CHECKPOINTS))} "
                        f"{shlex.quote(str(s.run_dir / 'model.safetensors'))}")
    commands.append(f"dstrain report {run} -o {shlex.quote(str(s.run_dir / 'report.html'))}")
    return commands
