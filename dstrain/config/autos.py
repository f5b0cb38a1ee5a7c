"""HF-style "auto" values that need the model or DeepSpeed's defaults, and the "auto" nobody fills.

The Hugging Face Trainer fills reduce_bucket_size, stage3_prefetch_bucket_size and
stage3_param_persistence_threshold from the model's hidden size (integrations/deepspeed.py,
trainer_config_finalize); any other "auto" inside a section DeepSpeed's pydantic models read is
dropped by those models, which then use their default. The "auto"s linked to train.* (batch,
clipping, precision, optimizer and scheduler params) are filled where resolve.py renders them.
"""

from __future__ import annotations

from typing import Any

from dstrain.config import deepspeed_keys as dsk
from dstrain.config.deepspeed_keys import AUTO
from dstrain.config.layers import Merged, flatten, get_path
from dstrain.config.schema import RunConfig
from dstrain.errors import Problem


def check_autos_left(ds: dict[str, Any], merged: Merged, ignored: set[tuple[str, str]],
                      problems: list[Problem]) -> None:
    """An "auto" no rule filled is an error, unless it sits under a key DeepSpeed ignores anyway:
    there it is left out of the JSON (at any depth), so no "auto" reaches DeepSpeed."""
    prefixes = []
    for section_path, key in ignored:
        node = get_path(ds, section_path) if section_path else ds
        if isinstance(node, dict) and key in node and _drop_autos(node[key]):
            del node[key]
        prefixes.append(f"{section_path}.{key}" if section_path else key)
    for path, value in flatten(ds).items():
        full = f"deepspeed.{path}"
        if value == AUTO and not any(path == p or path.startswith(p + ".") for p in prefixes):
            problems.append(Problem("dstrain cannot fill in 'auto' for this key", merged.where(full),
                                    "set an explicit value (or remove the key to use DeepSpeed's default)"))


def _drop_autos(node: Any) -> bool:
    """Remove every "auto" inside `node`; True when `node` itself is "auto" (the caller removes it)."""
    if node == AUTO:
        return True
    if isinstance(node, dict):
        for key in [k for k, v in node.items() if _drop_autos(v)]:
            del node[key]
    elif isinstance(node, list):
        node[:] = [v for v in node if not _drop_autos(v)]
    return False


# The Hugging Face Trainer's rules for the ZeRO sizes it fills from the model's hidden size.
WIDTH_AUTOS = {"reduce_bucket_size": ("hidden^2", lambda h: h * h),
               "stage3_prefetch_bucket_size": ("0.9 x hidden^2", lambda h: int(0.9 * h * h)),
               "stage3_param_persistence_threshold": ("10 x hidden", lambda h: 10 * h)}
WIDTH_KWARGS = ("hidden_size", "d_model", "n_embd", "dim")  # a user model's width, when its kwargs name it


def model_width(config: RunConfig) -> tuple[int | None, str]:
    """The model's hidden size without building it, and where it came from."""
    if config.model.name == "gpt":
        return config.model.d_model, f"model.d_model={config.model.d_model}"
    for key in WIDTH_KWARGS:
        value = config.model.kwargs.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, f"model.kwargs.{key}={value}"
    return None, f"the width of {config.model.name} is not known without building it"


def fill_width_autos(ds: dict[str, Any], config: RunConfig, notes: dict[str, str]) -> None:
    """reduce_bucket_size, stage3_prefetch_bucket_size, stage3_param_persistence_threshold: "auto"
    is filled from the model width as the Hugging Face Trainer does, or DeepSpeed's default."""
    zero = ds.get("zero_optimization")
    if not isinstance(zero, dict):
        return
    width, origin = model_width(config)
    zero_model = dsk.zero_keys()
    for key, (rule, from_width) in WIDTH_AUTOS.items():
        if zero.get(key) != AUTO:
            continue
        default = zero_model.defaults.get(zero_model.aliases.get(key, key)) if zero_model else None
        if width is None and default is None:
            continue  # left to the "cannot fill in" check
        zero[key] = from_width(width) if width is not None else default
        notes[f"deepspeed.zero_optimization.{key}"] = (f"auto: {rule} from {origin}" if width is not None else
                                                       f"auto: DeepSpeed's default ({origin})")


def fill_model_autos(ds: dict[str, Any], notes: dict[str, str]) -> None:
    """Any other "auto" inside a section DeepSpeed's pydantic models read: those models drop "auto"
    and use their default, so dstrain writes that default (or drops the key when it has none)."""
    for section in dsk.sections():
        node = get_path(ds, section.path) if section.refuses_unknown else None
        if not isinstance(node, dict):
            continue
        for key in [k for k, v in node.items() if v == AUTO]:
            name = section.aliases.get(key, key)
            path = f"deepspeed.{section.path}.{key}"
            if section.defaults.get(name) is not None:
                node[key] = section.defaults[name]
                notes[path] = f"auto: {section.reader}'s default"
            else:
                del node[key]
