"""A model entry point for launcher tests: the built-in GPT, built after writing down what the
process building it sees (its environment and the DeepSpeed config it is about to initialize with).

Config: model.name=rank_recorder:build, model.kwargs.record_dir=DIR, with tests/ on PYTHONPATH.
Each process writes DIR/<RANK>.json (`launcher.json` for the check `dstrain run` makes before launching).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from dstrain.models.gpt import GPT


def _caller_ds_config() -> dict | None:
    """The `ds_config` the worker holds for deepspeed.initialize, found up the call stack."""
    frame = sys._getframe(1)
    while frame is not None:
        if isinstance(frame.f_locals.get("ds_config"), dict):
            return frame.f_locals["ds_config"]
        frame = frame.f_back
    return None


def build(record_dir: str, **gpt_kwargs) -> GPT:
    who = os.environ.get("RANK", "launcher")
    seen = {"env": dict(os.environ), "ds_config": _caller_ds_config()}
    Path(record_dir, f"{who}.json").write_text(json.dumps(seen))
    return GPT(**gpt_kwargs)
