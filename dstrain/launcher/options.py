"""What the user asked `dstrain run` / `dstrain eval` for: the command line, as one value.

Filled by dstrain/cli.py and read by the rest of the launcher; no checks here (topology.py checks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class LaunchOptions:
    preset: str | None = None
    config_file: Path | None = None
    sets: list[str] = field(default_factory=list)
    gpus: int | None = None
    nodes: int | None = None  # not given: every host of the hostfile, else one node
    hostfile: Path | None = None
    include: str | None = None
    exclude: str | None = None
    master_port: int | None = None
    master_addr: str | None = None
    launcher: str | None = None
    node_rank: int | None = None
    no_ssh: bool = False
    accelerator: str = "auto"
    run_dir: Path | None = None
    resume: str | None = None
    join_timeout_s: float | None = None  # --join-timeout: train.join_timeout_s for this launch (None: the config's)
    dry_run: bool = False
    verbose: bool = False
    strict: bool | None = None  # --strict; None: DSTRAIN_STRICT in this command's environment decides
