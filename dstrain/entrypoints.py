"""Loading user code named as "package.module:function" (model.name, data.source) or "module:Class"
(train.log_to) in a config.

Entry points are code execution: a config that names one runs that code (see README, Security).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Callable

from dstrain.errors import UserError


def is_entry_point(name: str) -> bool:
    return ":" in name


def load_entry_point(spec: str, key: str) -> Callable:
    """Import `module:function` and return the function, or a UserError naming the key and the fix."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise UserError.single(f"{spec!r} is not an entry point", key,
                               "write 'package.module:function', e.g. 'my_models:build' (or 'gpt' for the built-in)")
    cwd = str(Path.cwd())
    if cwd not in sys.path:  # user modules next to the config, as `python -m` would find them
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        missing = getattr(err, "name", None) or ""
        if missing and missing != module_name and not module_name.startswith(missing + "."):
            # the module exists but imports a package that is not installed
            raise UserError.single(f"importing {module_name!r} failed: {err}", key,
                                   f"install the package it needs ({missing}) or remove that import") from None
        raise UserError.single(f"cannot import module {module_name!r}: {err}", key,
                               "check the module name and that it is on PYTHONPATH or in the current "
                               "directory (entry points are imported from where you run dstrain)") from None
    except Exception as err:  # noqa: BLE001 - user code failing at import is still the user's input
        raise UserError.single(f"importing {module_name!r} failed: {type(err).__name__}: {err}", key,
                               "fix the error in that module") from None
    func = getattr(module, attr, None)
    if not callable(func):
        raise UserError.single(f"module {module_name!r} has no function {attr!r}", key,
                               "check the function name after the ':'")
    return func


def call_entry_point(func: Callable, spec: str, key: str, kwargs_key: str, kwargs: dict):
    """Call a user's entry point; its own failure is bad input (exit 2), named with its keys."""
    try:
        return func(**kwargs)
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001 - the user's function failing is a problem with their input
        raise UserError.single(f"calling {spec}(**{kwargs_key}) failed: {type(err).__name__}: {err}",
                               f"{key} / {kwargs_key}", f"check the function and the keys in {kwargs_key}")


TRACKER_METHODS = ("log_metrics", "log_event", "close")  # and, optionally, rewind(step)


def load_tracker_class(spec: str, key: str) -> type:
    """Import a user's tracker `module:Class` and check that it is a class with the tracker methods
    (dstrain/rank/trackers.py describes them); a UserError naming the key otherwise."""
    cls = load_entry_point(spec, key)
    missing = [m for m in TRACKER_METHODS if not callable(getattr(cls, m, None))]
    if isinstance(cls, type) and not missing:
        return cls
    what = f"lacks {', '.join(missing)}" if isinstance(cls, type) else "is not a class"
    raise UserError.single(f"tracker {spec} {what}", key,
                           "name a class whose __init__ takes (run_dir, hparams, start_step) and that has "
                           "log_metrics(step, values), log_event(step, kind, fields) and close()")
