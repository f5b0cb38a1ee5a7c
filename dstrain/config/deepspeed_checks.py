"""Checks and translations of the deepspeed section, key by key, before anything else reads it.

The rule for an unknown key (DeepSpeed ignores it: a warning, an error when strict; a likely
misspelling of a key DeepSpeed reads, or a key DeepSpeed's own model refuses or has removed: an
error), DeepSpeed's numeric bounds, and the old spellings DeepSpeed still reads (cpu_offload,
bfloat16, ...), translated with a warning. What DeepSpeed reads comes from `deepspeed_keys`.
"""

from __future__ import annotations

from typing import Any

from dstrain.config import deepspeed_keys as dsk
from dstrain.config.deepspeed_keys import AUTO
from dstrain.config.layers import DEFAULT, Merged, get_path
from dstrain.errors import Problem


def check_keys(merged: Merged, problems: list[Problem], warnings: list[str], strict: bool) -> set[tuple[str, str]]:
    """Every key of the deepspeed section, at every depth dstrain knows, against what DeepSpeed reads.

    A key DeepSpeed would silently ignore is a warning (an error with `strict`); a likely misspelling
    of a key it reads is an error; an unknown key where DeepSpeed's own model refuses it is an error.
    Returns the keys DeepSpeed ignores, as (section path, key) (whatever they hold, "auto" included).
    """
    ignored: set[tuple[str, str]] = set()
    ds = merged.data["deepspeed"]
    zero = ds.get("zero_optimization")
    if isinstance(zero, bool):  # the oldest spelling: "zero_optimization": true meant stage 1
        warnings.append(f"{merged.where('deepspeed.zero_optimization')}: 'true' is deprecated; "
                        "read as {stage: 1}. Write zero_optimization: {stage: 1}")
        ds["zero_optimization"] = zero = {"stage": 1 if zero else 0}
    if zero is not None and not isinstance(zero, dict):
        problems.append(Problem("must be a mapping", merged.where("deepspeed.zero_optimization"),
                                "e.g. zero_optimization: {stage: 2}"))
    elif isinstance(zero, dict):
        _translate_deprecated_zero(zero, merged, warnings)
        stage = zero.get("stage")
        if isinstance(stage, str) and stage.strip().isdigit() or isinstance(stage, float) and stage.is_integer():
            zero["stage"] = int(stage)  # "3" and 3.0: DeepSpeed's model reads both as 3
    _translate_bfloat16(ds, merged, warnings)
    _quoted_batch_numbers(ds, merged, problems)
    removed = dsk.removed_keys()
    for section in dsk.sections():
        node = ds if not section.path else get_path(ds, section.path)
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            path = _ds_path(section.path, key)
            if key in removed.get(section.path, ()):
                problems.append(Problem("DeepSpeed has removed this key and refuses configs that have it",
                                        merged.where(path), "remove it"))
            elif key in dsk.REFUSED_AT_BUILD.get(section.path, {}):
                problems.append(Problem("DeepSpeed refuses this key when it builds the engine (every rank would "
                                        "stop at start)", merged.where(path),
                                        dsk.REFUSED_AT_BUILD[section.path][key]))
            elif dsk.is_comment(key):
                ignored.add((section.path, key))
            elif key not in section.names and _unknown_key(section, key, value, path, merged, problems, warnings,
                                                           strict):
                ignored.add((section.path, key))
        _check_bounds(section, node, merged, problems)
    return ignored


def _unknown_key(section: dsk.SectionKeys, key: str, value: Any, path: str, merged: Merged,
                 problems: list[Problem], warnings: list[str], strict: bool) -> bool:
    """Report one unknown key; True when it is a key DeepSpeed ignores (a warning)."""
    what = {"": "DeepSpeed", "zero_optimization": "ZeRO"}.get(section.path, section.path.rsplit(".", 1)[-1])
    what = "offload" if what.startswith("offload_") else what
    where = merged.where(path)
    typo = dsk.misspelling_of(key, section.names)
    hint = f"did you mean {typo!r}?" if typo else dsk.suggest(key, section.names)
    home = dsk.home_of(key, section.path) if not typo else None
    if home is not None:  # e.g. the old zero_optimization.aio, or ZeRO++ keys written at the top level
        hint = f"it belongs {'at the top level' if home == '' else 'in deepspeed.' + home}: move it to " + \
               ".".join(p for p in ("deepspeed", home, key) if p)
    if section.refuses_unknown and value != AUTO:  # DeepSpeed's models drop "auto" values before checking
        problems.append(Problem(f"unknown {what} key: {section.reader} refuses it (DeepSpeed would stop at start)",
                                where, hint or "remove it; valid keys: " + _some(sorted(section.names))))
        return False
    ignored = ("DeepSpeed ignores it" if not section.path.endswith("params") else
               f"not a parameter dstrain knows; DeepSpeed passes it unchecked to {section.reader}")
    if typo:
        problems.append(Problem(f"unknown {what} key, likely a misspelling of {typo!r} ({ignored}, so the "
                                "setting would silently not apply)", where, hint))
    elif strict:
        problems.append(Problem(f"unknown {what} key: {ignored} (an error with --strict / DSTRAIN_STRICT=1)",
                                where, (hint + " " if hint else "") + "remove it, or run without --strict"))
    else:
        warnings.append(f"{where}: unknown {what} key; {ignored}" + (f" ({hint})" if hint else ""))
        return True
    return False


BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _quoted_batch_numbers(ds: dict, merged: Merged, problems: list[Problem]) -> None:
    """DeepSpeed reads the batch keys with dict lookups and does arithmetic on them: a quoted number ("8")
    stops it at start with "TypeError: '>' not supported between 'str' and 'int'" (Open-Assistant's
    deepspeed_rl.json), so dstrain refuses it too, with the fix, rather than run what DeepSpeed would not."""
    for key in BATCH_KEYS:
        value = ds.get(key)
        if isinstance(value, str) and value != AUTO:
            problems.append(Problem(f"must be a number, not the string {value!r}: DeepSpeed's batch arithmetic stops "
                                    "at start with a TypeError", merged.where(f"deepspeed.{key}"),
                                    f"write {value.strip()} without quotes" if value.strip().isdigit()
                                    else 'write a number, or "auto"'))


def _ds_path(section_path: str, key: str) -> str:
    return f"deepspeed.{section_path}.{key}" if section_path else f"deepspeed.{key}"


def _some(names: list[str], most: int = 12) -> str:
    return ", ".join(names[:most]) + (f", ... ({len(names)} in all)" if len(names) > most else "")


def _check_bounds(section: dsk.SectionKeys, node: dict, merged: Merged, problems: list[Problem]) -> None:
    """Numeric bounds of DeepSpeed's own model fields, checked before anything imports DeepSpeed."""
    for key, value in node.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        name = section.aliases.get(key, key)
        for bound in section.bounds.get(name, ()):
            if not bound.allows(value):
                default = section.defaults.get(name)
                problems.append(Problem(f"must be {bound.describe()} (got {value}), as {section.reader} requires",
                                        merged.where(_ds_path(section.path, key)),
                                        f"DeepSpeed's default is {default}, or remove the key" if default is not None
                                        else "remove the key to use DeepSpeed's default"))
                break


def _translate_bfloat16(ds: dict, merged: Merged, warnings: list[str]) -> None:
    """DeepSpeed still reads the old section name "bfloat16" when "bf16" is absent (precision_config.py)."""
    if "bfloat16" not in ds:
        return
    where = merged.where("deepspeed.bfloat16")
    old = ds.pop("bfloat16")
    if "bf16" in ds:
        warnings.append(f"{where}: DeepSpeed ignores it because deepspeed.bf16 is set; remove it")
        return
    ds["bf16"] = old
    for path in [p for p in merged.sources if p == "deepspeed.bfloat16" or p.startswith("deepspeed.bfloat16.")]:
        merged.sources["deepspeed.bf16" + path[len("deepspeed.bfloat16"):]] = merged.sources.pop(path)
    warnings.append(f"{where}: the old name of deepspeed.bf16; read as bf16. Write that instead.")


def _translate_deprecated_zero(zero: dict, merged: Merged, warnings: list[str]) -> None:
    """DeepSpeed's deprecated ZeRO spellings become the modern ones, each with a warning."""
    base = "deepspeed.zero_optimization"
    moves = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}
    for old, new in moves.items():
        if old in zero:
            enabled = zero.pop(old)
            src = merged.sources.pop(f"{base}.{old}", DEFAULT)
            if enabled and not isinstance(zero.get(new), dict):
                zero[new] = {"device": "cpu"}
                merged.sources[f"{base}.{new}.device"] = src
            warnings.append(f"{src.label}: {base}.{old} is deprecated; read as {new}: "
                            f"{{device: {'cpu' if enabled else 'none'}}}. Write that instead.")
    if "cpu_offload_use_pin_memory" in zero:
        pin = zero.pop("cpu_offload_use_pin_memory")
        src = merged.sources.pop(f"{base}.cpu_offload_use_pin_memory", DEFAULT)
        for new in moves.values():
            if isinstance(zero.get(new), dict):
                zero[new].setdefault("pin_memory", pin)
        warnings.append(f"{src.label}: {base}.cpu_offload_use_pin_memory is deprecated; read as pin_memory "
                        "in offload_optimizer/offload_param. Write that instead.")
    old16 = "stage3_gather_fp16_weights_on_model_save"
    if old16 in zero:
        value = zero.pop(old16)
        src = merged.sources.pop(f"{base}.{old16}", DEFAULT)
        if "stage3_gather_16bit_weights_on_model_save" not in zero:  # the modern spelling wins
            zero["stage3_gather_16bit_weights_on_model_save"] = value
            merged.sources[f"{base}.stage3_gather_16bit_weights_on_model_save"] = src
        warnings.append(f"{src.label}: {base}.{old16} is deprecated; read as "
                        "stage3_gather_16bit_weights_on_model_save. Write that instead.")
