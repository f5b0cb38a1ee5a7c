"""Validate the rendered DeepSpeed config with DeepSpeed's own pydantic models (imports DeepSpeed).

Part of resolution (`dstrain config`, `run`, `--dry-run` and `estimate` alike), so every command gives
DeepSpeed's verdict on a value: a wrong one (types included: `fp16.min_loss_scale: 0.05` must be an
integer) is exit code 2 naming the file and key path, not a stack trace from every rank a minute later.
The key-name and bound checks of `deepspeed_keys` come first and need no import; this step costs the
import of DeepSpeed's config modules (about 2 s, torch included), paid once per process.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from typing import Any, Callable

from dstrain.config import deepspeed_keys as dsk
from dstrain.config.deepspeed_keys import MODEL_SECTIONS
from dstrain.config.layers import get_path
from dstrain.errors import Problem

FIX = "see DeepSpeed's config documentation for this key"


def available() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def _model(rel: str, class_name: str):
    name = "deepspeed." + rel.removesuffix(".py").replace("/", ".")
    if name not in __import__("sys").modules:
        # DeepSpeed's first import logs which accelerator it picked; a config check has nothing to say about it
        logging.disable(logging.WARNING)
        try:
            importlib.import_module(name)
        finally:
            logging.disable(logging.NOTSET)
    return getattr(importlib.import_module(name), class_name)


def _fix(path: str) -> str:
    """DeepSpeed's default for the key when its source states one, else where to look."""
    parent, _, name = path.rpartition(".")
    section = dsk.section(parent)
    if section is not None and name in section.defaults and name not in ("enabled",):
        return f"DeepSpeed's default is {section.defaults[name]!r}: write a value of that kind, or remove the key"
    return FIX


def validate(ds_config: dict[str, Any], where: Callable[[str], str] = lambda path: path) -> list[Problem]:
    """DeepSpeed's models on each section they read; `where` turns a key path into 'file: path'."""
    import pydantic

    problems: list[Problem] = []
    for key, (rel, class_name) in MODEL_SECTIONS.items():
        if key.startswith("zero_optimization."):
            continue  # the offload sections are fields of DeepSpeedZeroConfig: checked with it
        value = get_path(ds_config, key)
        if value is None:
            continue
        if not isinstance(value, dict):
            problems.append(Problem("must be a mapping", where(f"deepspeed.{key}"), "see DeepSpeed's config documentation"))
            continue
        model = _model(rel, class_name)
        try:
            model(**value)
        except pydantic.ValidationError as err:
            for e in err.errors():
                loc = [str(p) for p in e["loc"]]
                path = ".".join(["deepspeed", key, *loc])
                got = repr(e.get("input"))
                got = got if len(got) <= 60 else got[:57] + "..."
                problems.append(Problem(f"{e['msg']} (DeepSpeed's {model.__name__}; got {got})", where(path),
                                        _fix(".".join([key, *loc]))))
        except (ValueError, TypeError, AssertionError) as err:
            problems.append(Problem(f"{err} (DeepSpeed's {model.__name__})", where(f"deepspeed.{key}"), FIX))
    return problems


def check_whole(ds_config: dict[str, Any]) -> str | None:
    """DeepSpeed's whole config check (deepspeed.runtime.config.DeepSpeedConfig: every section it parses,
    its removed keys, its sanity checks), as deepspeed.initialize runs it in every rank; None when it
    passes, else its message. Run outside a process group, DeepSpeedConfig sees a world of 1, so the
    batch keys are given as one rank sees them (dstrain checks the batch arithmetic at the real world size)."""
    import copy
    config = copy.deepcopy(ds_config)
    micro, accum = config.get("train_micro_batch_size_per_gpu"), config.get("gradient_accumulation_steps")
    if isinstance(micro, int) and isinstance(accum, int):
        config["train_batch_size"] = micro * accum
    _model("runtime/config.py", "DeepSpeedConfig")  # imported quietly
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.utils import logger
    level = logger.level
    logger.setLevel(logging.ERROR)  # its INFO lines and warnings about the hardware are not a verdict
    try:
        DeepSpeedConfig(config)
    except Exception as err:  # noqa: BLE001 - DeepSpeed raises many types; its message is the verdict
        lines = [line.strip() for line in str(err).splitlines() if line.strip()
                 and not line.strip().startswith("For further information")]
        return f"{type(err).__name__}: {' / '.join(lines)}"[:400]
    finally:
        logger.setLevel(level)
    return None
