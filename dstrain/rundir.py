"""The run directory: the only thing that crosses from the `dstrain` command to its ranks.

`dstrain run` (dstrain/launcher/) writes CONFIG, DS_CONFIG, LAUNCH and, when the DeepSpeed config
holds secrets, SECRETS; every rank (dstrain/rank/) reads them back with `read` and writes its pid
and exit record, heartbeat and stack dump under RANKS, the metrics to METRICS and checkpoints under CHECKPOINTS. No flags and
no pickles cross the boundary: the deepspeed runner would parse flags meant for us, and files are
what a user can read, copy and resume from. This module owns the names and the atomic write; it
imports neither torch nor DeepSpeed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

CONFIG = "config.yaml"            # the resolved dstrain config (secrets redacted)
DS_CONFIG = "ds_config.json"      # exactly what deepspeed.initialize gets (secrets redacted)
LAUNCH = "launch.json"            # world size, accelerator, resume target, mode ("eval" for dstrain eval)
SECRETS = ".secrets.json"         # 0600: the redacted values, key path -> value
RANKS = "ranks"                   # rank<R>.pid/.exit records, .log output, .beat heartbeats, .stack dumps
METRICS = "metrics.jsonl"         # one JSON object per logged step or event
CHECKPOINTS = "checkpoints"       # one folder per tag (see dstrain/checkpoints.py)
TENSORBOARD = "tensorboard"       # train.log_to tensorboard: event files
WANDB = "wandb"                   # train.log_to wandb: W&B's run files (offline runs too) and our run id
CSV = "metrics.csv"               # train.log_to csv: one row per logged step, evaluation or event
HEALTH = "health.json"            # the run health guard's rollbacks and skipped data steps (rank 0)
LOCK = "run.lock"                 # held (flock) by the job that owns the directory; its host, pid, command inside
HF_SOURCE = "hf_source"           # an hf: model's config.json, tokenizer files, LoRA layers and peft's
                                  # adapter_config.json (for --format hf / peft)
HF_LORA = "dstrain_lora.json"     # in HF_SOURCE: each LoRA layer's scaling and layout (written by rank 0)
HF_SOURCE_KEYS = "dstrain_source_keys.json"  # in HF_SOURCE: the source checkpoint's weight keys, so that
                                  # --format hf writes its layout (e.g. per-expert MoE tensors)
RUN_FILES = (CONFIG, DS_CONFIG, LAUNCH)
GAVE_UP = "run health gave up"    # how a rank's exit record starts when the run health guard gave up
DIED = "died"                     # the kind of exit record a rank's own `dstrain run` writes for a rank that ended
                                  # without writing one (SIGKILL, out of memory): other nodes read it
# "<pid of dstrain run>:<file>": ranks started while `dstrain run` still checks (launcher/early_start.py)
# wait until that file says "go", and leave quietly when that process is gone.
START_GATE_ENV = "DSTRAIN_START_GATE"


def exit_record(run_dir: Path, rank: int) -> Path:
    """How a rank ended, one line "<kind>: <detail>", written once (by the rank, or for it by a launcher or a node)."""
    return run_dir / RANKS / f"rank{rank}.exit"


def record_rank(path: Path) -> int:
    """The rank a record in RUN_DIR/ranks (rank<R>.exit, .pid, .log, ...) belongs to."""
    return int(path.name.split(".")[0].removeprefix("rank"))


def rank_log(run_dir: Path, rank: int) -> Path:
    """A rank's log: its stderr, known third-party noise and a failure's traceback (dstrain/rank/output.py)."""
    return run_dir / RANKS / f"rank{rank}.log"


class ResumeTarget(BaseModel):
    """The checkpoint a rank loads before its first step."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    directory: str
    """The folder holding the checkpoint's tag folder (the run's checkpoints/, or its universal/ copy)."""
    tag: str
    step: int
    universal: bool
    """Saved by another world size: loaded through DeepSpeed's universal checkpoint."""


class LaunchInfo(BaseModel):
    """LAUNCH: what `dstrain run` (or `dstrain eval`) decided about this launch, beside the config files."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["train", "eval"] = "train"  # launch.json files written before "mode" existed were training's
    world_size: int
    accelerator: Literal["cpu", "cuda"]
    verbose: bool
    preset: str | None
    config_hash: str
    """The model/data config's hash, stored in each checkpoint so a resume can refuse another config."""
    dstrain_version: str
    hang_timeout_s: float
    """train.hang_timeout_s resolved for the accelerator; 0: no hang detection."""
    resume: ResumeTarget | None
    output: str | None = None
    """mode "eval": the file rank 0 writes the evaluation result to."""

    @classmethod
    def read(cls, run_dir: Path) -> "LaunchInfo":
        """LAUNCH of `run_dir`; a UserError naming the file when it is not one this dstrain writes."""
        from pydantic import ValidationError

        from dstrain.errors import UserError
        path = Path(run_dir) / LAUNCH
        try:
            return cls.model_validate_json(path.read_text())
        except ValidationError as err:
            wrong = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(file)'}: {e['msg']}" for e in err.errors())
            raise UserError.single(f"not a launch file of this dstrain version ({wrong})", str(path),
                                   "start the run again with `dstrain run` (add --resume latest to continue it)") from None

    def write(self, run_dir: Path) -> None:
        write_atomic(Path(run_dir) / LAUNCH, self.model_dump_json(indent=2))


def write_atomic(path: Path, text: str) -> None:
    """Write via a temporary file and rename, so readers see the old or the new content, never half."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def missing_files(run_dir: Path) -> list[str]:
    """The run files a rank or `dstrain eval` needs that `run_dir` lacks."""
    return [name for name in RUN_FILES if not (run_dir / name).is_file()]


def read(run_dir: Path) -> tuple[Any, dict, LaunchInfo]:
    """(RunConfig, DeepSpeed config with its secrets restored, launch info) as a rank needs them."""
    import yaml

    from dstrain.config.layers import set_path
    from dstrain.config.schema import RunConfig
    config = RunConfig.model_validate(yaml.safe_load((run_dir / CONFIG).read_text()))
    ds_config = json.loads((run_dir / DS_CONFIG).read_text())
    secrets_file = run_dir / SECRETS
    if secrets_file.exists():  # secrets are kept out of the readable config files
        for path, value in json.loads(secrets_file.read_text()).items():
            set_path(ds_config, path, value)
    return config, ds_config, LaunchInfo.read(run_dir)
