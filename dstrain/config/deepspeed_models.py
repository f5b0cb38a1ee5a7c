"""Validate the rendered DeepSpeed config with DeepSpeed's own pydantic models (imports DeepSpeed).

Used by `dstrain run` (dry runs too) before any rank starts, so a wrong value is exit code 2 with
the key path, not a stack trace from every rank a minute later. `dstrain config` skips this to
stay torch-free; its key-name and bound checks come from `deepspeed_keys`, which names the same
models (MODEL_SECTIONS) and reads them from DeepSpeed's source.
"""

from __future__ import annotations

import importlib
from typing import Any

from dstrain.config.deepspeed_keys import MODEL_SECTIONS
from dstrain.config.layers import get_path
from dstrain.errors import Problem


def validate(ds_config: dict[str, Any]) -> list[Problem]:
    import pydantic

    problems: list[Problem] = []
    for key, (rel, class_name) in MODEL_SECTIONS.items():
        if key.startswith("zero_optimization."):
            continue  # the offload sections are fields of DeepSpeedZeroConfig: checked with it
        value = get_path(ds_config, key)
        if value is None:
            continue
        model = getattr(importlib.import_module("deepspeed." + rel.removesuffix(".py").replace("/", ".")), class_name)
        if not isinstance(value, dict):
            problems.append(Problem("must be a mapping", f"deepspeed.{key}", "see DeepSpeed's config documentation"))
            continue
        try:
            model(**value)
        except pydantic.ValidationError as err:
            for e in err.errors():
                path = ".".join(["deepspeed", key, *(str(p) for p in e["loc"])])
                problems.append(Problem(f"{e['msg']} (DeepSpeed's {model.__name__})", path,
                                        "see DeepSpeed's config documentation for this key"))
        except (ValueError, TypeError, AssertionError) as err:
            problems.append(Problem(f"{err} (DeepSpeed's {model.__name__})", f"deepspeed.{key}",
                                    "see DeepSpeed's config documentation for this key"))
    return problems
