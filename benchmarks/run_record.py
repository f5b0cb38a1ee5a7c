"""What every benchmark script writes beside its rows: the installed versions, and the --json file of a
run (date, host, GPU, versions, settings, rows). Imported by the scripts next to it (run as files)."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

PACKAGES = ("torch", "deepspeed", "transformers", "peft", "flash-attn", "lightning", "dstrain")


def versions(packages: tuple[str, ...] = PACKAGES) -> dict:
    """Each package's installed version, None where it is not installed."""
    import importlib.metadata as md
    out = {}
    for package in packages:
        try:
            out[package] = md.version(package)
        except md.PackageNotFoundError:
            out[package] = None
    return out


def write_json(path: Path, settings: dict, rows: list[dict], quiet: bool = False) -> None:
    """The run's record: when, where (host and GPU), the versions, the settings and every row."""
    import torch
    path.write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "host": platform.node(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "versions": versions(), "settings": {k: str(v) for k, v in settings.items()}, "rows": rows},
        indent=2) + "\n")
    if not quiet:
        print(f"written to {path}")
