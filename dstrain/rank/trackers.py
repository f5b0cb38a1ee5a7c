"""Experiment trackers (`train.log_to`): TensorBoard, Weights & Biases, CSV and a user's own "module:Class",
behind one small interface.

Rank 0's MetricsLog hands every logged record to each tracker: `log_metrics(step, values)` with the
same numbers metrics.jsonl gets, `log_event(step, kind, fields)` for events (rollbacks and the like),
`close()` at the end, and `rewind(step)` (optional for a user's class) after a rollback. Hyper-parameters (the resolved config, flattened to dotted keys) are written
when a tracker opens.

Why not DeepSpeed's own monitor (deepspeed.monitor, the `tensorboard`/`wandb`/`csv_monitor` keys of
the DeepSpeed config): enabled there, the engine writes lr every step and its CSV monitor reopens a
file per scalar per event; it cannot take hyper-parameters or text events, its TensorBoard writer
cannot purge the steps a resumed run repeats, its W&B monitor cannot set the run's directory, config
or id (so a resumed run would start a second W&B run), and its CSV monitor writes the header again
after every restart. So each tracker here drives its library directly; DeepSpeed's monitor keys stay
available in the `deepspeed` section for anyone who wants the engine's own timers.
"""

from __future__ import annotations

import csv
import json
import os
import secrets
import time
from pathlib import Path
from typing import Any, Protocol

from dstrain import rundir
from dstrain.run_summary import describe_event

# Tracker tag of each metrics.jsonl key: "group/key", so TensorBoard and W&B show related charts together.
GROUPS = {"loss": "train", "eval_loss": "eval", "lr": "train", "grad_norm": "train", "loss_scale": "fp16",
          "skipped_steps": "fp16", "tokens_per_s": "speed", "real_tokens_per_s": "speed", "tflops_per_device": "speed", "mfu": "speed",
          "data_wait_ms": "speed", "step_time_ms": "speed", "memory_gib": "memory",
          "gpu_mem_allocated_gib": "memory", "gpu_mem_reserved_gib": "memory", "host_rss_gib": "memory"}

# The CSV's columns; keys outside this list (event fields, say) go to its "details" column as JSON.
CSV_COLUMNS = ("time", "step", "event", "loss", "eval_loss", "lr", "grad_norm", "tokens_per_s", "real_tokens_per_s",
               "tflops_per_device", "mfu", "data_wait_ms", "step_time_ms", "memory_gib", "gpu_mem_allocated_gib",
               "gpu_mem_reserved_gib", "host_rss_gib", "loss_scale", "skipped_steps", "details")


def tag(key: str) -> str:
    return f"{GROUPS.get(key, 'other')}/{key}"


class Tracker(Protocol):
    name: str

    def log_metrics(self, step: int, values: dict[str, float]) -> None: ...

    def log_event(self, step: int, kind: str, fields: dict[str, Any]) -> None: ...

    def rewind(self, step: int) -> None:
        """The run went back to the checkpoint at `step` (a rollback): it logs steps after it again."""

    def close(self) -> None: ...


def flat_hparams(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train": {"lr": 1e-3}} -> {"train.lr": 1e-3}; lists and None become text (hparams take scalars)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flat_hparams(value, path + "."))
        elif isinstance(value, (bool, int, float, str)):
            out[path] = value
        else:
            out[path] = json.dumps(value)
    return out


def run_hparams(config, ds_config: dict[str, Any], world: int) -> dict[str, Any]:
    """The resolved run as flat hyper-parameters: the dstrain config, the DeepSpeed JSON as the engine
    got it (secrets redacted) and the world size."""
    from dstrain.config.resolve import redact
    return flat_hparams({**config.model_dump(mode="json", exclude={"deepspeed"}), "deepspeed": redact(ds_config),
                         "world_size": world})


def event_text(kind: str, step: int, fields: dict[str, Any]) -> str:
    return describe_event({"event": kind, "step": step, **fields})


class TensorBoardTracker:
    """RUN_DIR/tensorboard: scalars, the config as hyper-parameters and as text, events as text and a
    scalar marker. A resumed run (or a rollback, through `rewind`) hides the steps logged after the
    checkpoint it restarts from (TensorBoard's purge_step), so the curves show what the model went
    through, not the steps it lost; metrics.jsonl and the CSV keep them."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, hparams: dict[str, Any], start_step: int):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package: the launcher checked
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        # purge_step P: TensorBoard hides what earlier files logged at steps >= P
        self.open = lambda purge_step: SummaryWriter(log_dir=str(run_dir / rundir.TENSORBOARD), purge_step=purge_step)
        self.writer = self.open(start_step + 1 if start_step else None)
        if start_step == 0:  # once per run: the HParams dashboard lists a run once
            # Written into this run's own event file (SummaryWriter.add_hparams would open a second run).
            for summary in hparams_summary(hparams, {tag("loss"): None, tag("eval_loss"): None}):
                self.writer.file_writer.add_summary(summary)
            self.writer.add_text("config", "\n".join(f"    {k}: {v}" for k, v in sorted(hparams.items())), 0)
        self.writer.flush()

    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(tag(key), value, step)
        self.writer.flush()  # at log steps only: someone is watching the curves now

    def log_event(self, step: int, kind: str, fields: dict[str, Any]) -> None:
        self.writer.add_scalar(f"events/{kind}", 1.0, step)
        self.writer.add_text(f"events/{kind}", event_text(kind, step, fields), step)
        self.writer.flush()

    def rewind(self, step: int) -> None:
        self.writer.close()
        self.writer = self.open(step + 1)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """Weights & Biases, files under RUN_DIR/wandb. WANDB_MODE=offline (or `wandb offline`) keeps
    everything local; WANDB_PROJECT names the project (default "dstrain"). The run id is kept in
    RUN_DIR/wandb/dstrain_run_id, so a resumed run continues the same W&B run. Every metric is
    plotted against the training step (a custom step metric), which may go back after a rollback or
    resume, where W&B's own step may not."""

    name = "wandb"

    def __init__(self, run_dir: Path, hparams: dict[str, Any], start_step: int):
        import wandb

        directory = run_dir / rundir.WANDB
        directory.mkdir(exist_ok=True)
        id_file = directory / "dstrain_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)  # W&B ids: [a-z0-9]
        id_file.write_text(run_id)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "dstrain"), name=run_dir.resolve().name,
                              dir=str(run_dir), id=run_id, resume="allow", config=hparams,
                              settings=wandb.Settings(quiet=True))  # no run summary printed at the end
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        self.run.log({"step": step, **{tag(k): v for k, v in values.items()}})

    def log_event(self, step: int, kind: str, fields: dict[str, Any]) -> None:
        numbers = {f"events/{kind}/{k}": v for k, v in fields.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        self.run.log({"step": step, f"events/{kind}": 1, **numbers})
        self.run.summary[f"events/{kind}/last"] = event_text(kind, step, fields)

    def rewind(self, step: int) -> None:  # the step axis is ours: repeated steps plot where they belong
        pass

    def close(self) -> None:
        self.run.finish()


class CsvTracker:
    """RUN_DIR/metrics.csv: one row per logged step, evaluation or event, fixed columns (CSV_COLUMNS),
    appended across resumes with one header."""

    name = "csv"

    def __init__(self, run_dir: Path, hparams: dict[str, Any], start_step: int):
        path = run_dir / rundir.CSV
        fresh = not path.exists() or path.stat().st_size == 0
        self.file = open(path, "a", newline="")
        self.writer = csv.DictWriter(self.file, fieldnames=CSV_COLUMNS)
        if fresh:
            self.writer.writeheader()
            self.file.flush()

    def _row(self, record: dict[str, Any]) -> None:
        extra = {k: v for k, v in record.items() if k not in CSV_COLUMNS}
        row = {k: record[k] for k in CSV_COLUMNS if k in record}
        if extra:
            row["details"] = json.dumps(extra)
        self.writer.writerow(row)
        self.file.flush()

    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        self._row({"time": round(time.time(), 3), "step": step, **values})

    def log_event(self, step: int, kind: str, fields: dict[str, Any]) -> None:
        self._row({"time": round(time.time(), 3), "step": step, "event": kind, **fields})

    def rewind(self, step: int) -> None:  # a log: rows of repeated steps follow the rollback's event row
        pass

    def close(self) -> None:
        self.file.close()


TRACKERS = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "csv": CsvTracker}


def tracker_class(name: str) -> type:
    """The class a `train.log_to` name opens: a built-in, or a user's "module:Class" (entrypoints.py)."""
    from dstrain.entrypoints import is_entry_point, load_tracker_class
    return load_tracker_class(name, "train.log_to") if is_entry_point(name) else TRACKERS[name]


def open_trackers(names: list[str], run_dir: Path, hparams: dict[str, Any], start_step: int) -> list[Tracker]:
    """The trackers `train.log_to` names, opened (the launcher checked before the ranks started that
    their packages are installed). One that cannot start (W&B online without a login, say) is bad
    input: the run stops before its first step with the library's reason."""
    from dstrain.errors import UserError
    opened = []
    for name in dict.fromkeys(names):
        cls = tracker_class(name)
        try:
            opened.append(cls(run_dir, hparams, start_step))
        except Exception as err:  # noqa: BLE001 - whatever the library raises, named in the message
            for tracker in opened:
                tracker.close()
            fix = ("log in (wandb login), or set WANDB_MODE=offline" if name == "wandb"
                   else f"remove {name} from train.log_to")
            raise UserError.single(f"the {name} tracker could not start: {type(err).__name__}: {err}",
                                   "train.log_to", fix) from err
    return opened
