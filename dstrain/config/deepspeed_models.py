"""Validate the rendered DeepSpeed config with DeepSpeed's own pydantic models (imports DeepSpeed).

Used by `dstrain run` (dry runs too) before any rank starts, so a wrong value is exit code 2 with
the key path, not a stack trace from every rank a minute later. `dstrain config` skips this to
stay torch-free; its key-name checks come from `deepspeed_keys`.
"""

from __future__ import annotations

from typing import Any

from dstrain.errors import Problem


def validate(ds_config: dict[str, Any]) -> list[Problem]:
    import pydantic
    from deepspeed.monitor.config import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    sections = {"zero_optimization": DeepSpeedZeroConfig, "fp16": DeepSpeedFP16Config, "bf16": DeepSpeedBF16Config,
                "tensorboard": TensorBoardConfig, "wandb": WandbConfig, "csv_monitor": CSVConfig, "comet": CometConfig}
    problems: list[Problem] = []
    for key, model in sections.items():
        value = ds_config.get(key)
        if value is None:
            continue
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
