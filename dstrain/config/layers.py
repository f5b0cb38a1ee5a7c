"""Build one run configuration from its layers, and remember which layer set each key.

Precedence, lowest to highest (a higher layer overrides a lower one key by key):

    1. schema defaults          (dstrain/config/schema.py)
    2. preset                   (--preset NAME, or the `preset:` key of the --config file)
    3. --config FILE            (YAML or JSON)
    4. PL_DEEPSPEED_CONFIG_PATH (a DeepSpeed JSON; as in PyTorch Lightning it *replaces* the
                                 deepspeed section of the layers below it)
       DSTRAIN_<KEY>            (the `speedups:` section's switches, e.g. DSTRAIN_ZERO3_STEP=off sets
                                 speedups.zero3_step; read here, in `dstrain run`, never in a rank)
    5. --set KEY.PATH=VALUE     (repeatable; the last one wins)

Some quantities can be set either as `train.*` or as a DeepSpeed key (batch sizes, precision,
lr, clipping). They are one quantity: the highest layer that sets either spelling wins and the
other follows (see `resolve.py`). "auto" values never win; they are filled in from the rest.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dstrain.config.files import parse_sets, read_deepspeed_json, read_mapping
from dstrain.config.presets import normalize, preset_path
from dstrain.errors import Problem, UserError
from dstrain.switches import switch

ENV_DEEPSPEED_CONFIG = "PL_DEEPSPEED_CONFIG_PATH"
ENV_SPEEDUP_PREFIX = "DSTRAIN_"  # DSTRAIN_<KEY> sets speedups.<key> (keys of schema.SpeedupsConfig)
# A number in these switches is their tuning number (as the variables have always taken it): the change
# on, and the number in its companion key.
ENV_SPEEDUP_NUMBERS = {"offload_chunks": "offload_chunk_elements", "offload_overlap": "offload_overlap_threads"}
DEFAULT_RANK = 0
PRESET_RANK = 1  # a preset's values: above dstrain's defaults, below everything the user gives


@dataclass(frozen=True)
class Source:
    """Where a value came from: its layer's rank (higher wins) and a label for messages."""

    rank: int
    label: str


DEFAULT = Source(DEFAULT_RANK, "default")


@dataclass
class Layer:
    source: Source
    data: dict[str, Any]
    replaces_deepspeed: bool = False
    warnings: list[str] = field(default_factory=list)  # e.g. a DeepSpeed JSON read leniently


@dataclass
class Merged:
    """All layers merged: the plain dict plus, for every leaf key path, the layer that set it."""

    data: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, Source] = field(default_factory=dict)
    preset: str | None = None
    warnings: list[str] = field(default_factory=list)

    def source_of(self, path: str) -> Source:
        """The source of a key path, of its nearest set ancestor (a whole section set at once),
        or of the highest layer that set a key below it."""
        parts = path.split(".")
        for end in range(len(parts), 0, -1):
            found = self.sources.get(".".join(parts[:end]))
            if found:
                return found
        # A section (e.g. a misspelt `zero_optimisation:`) has sources only on its leaves.
        below = [s for k, s in self.sources.items() if k.startswith(path + ".")]
        return max(below, key=lambda s: s.rank) if below else DEFAULT

    def where(self, path: str) -> str:
        """'<layer>: <path>' for messages, or just the path for a default."""
        source = self.source_of(path)
        return f"{source.label}: {path}" if source is not DEFAULT else path


def collect_layers(preset: str | None, config_file: Path | None, sets: list[str],
                   env: dict[str, str] | None = None) -> tuple[list[Layer], str | None]:
    """Read every layer above the defaults, in precedence order. Returns the layers and the preset name."""
    env = dict(os.environ) if env is None else env
    problems: list[Problem] = []
    layers: list[Layer] = []

    file_data: dict[str, Any] = {}
    if config_file is not None:
        try:
            file_data = read_mapping(config_file, "--config")
        except UserError as err:
            problems += err.problems
    file_preset = file_data.pop("preset", None) if isinstance(file_data, dict) else None
    if file_preset is not None and not isinstance(file_preset, str):
        problems.append(Problem("must be a preset name (a string)", f"--config {config_file}: preset",
                                "e.g. 'preset: stage2'"))
        file_preset = None
    chosen = preset or file_preset
    if chosen:
        try:
            path = preset_path(chosen, "--preset" if preset else f"--config {config_file}: preset")
            data = read_mapping(path, f"preset {normalize(chosen)}")
            data.pop("preset", None)
            layers.append(Layer(Source(PRESET_RANK, f"preset {normalize(chosen)}"), data))
        except UserError as err:
            problems += err.problems
    if config_file is not None:
        layers.append(Layer(Source(2, f"--config {config_file}"), file_data))

    env_path = env.get(ENV_DEEPSPEED_CONFIG)
    if env_path:
        try:
            ds, note = read_deepspeed_json(Path(env_path), ENV_DEEPSPEED_CONFIG)
            layers.append(Layer(Source(3, f"{ENV_DEEPSPEED_CONFIG} ({env_path})"), {"deepspeed": ds},
                                replaces_deepspeed=True, warnings=[note] if note else []))
        except UserError as err:
            for p in err.problems:
                p.fix = p.fix or f"point {ENV_DEEPSPEED_CONFIG} at a DeepSpeed JSON file, or unset it"
            problems += err.problems
    layers += speedup_layers(env)
    if sets:
        try:
            set_data = parse_sets(sets)
            if "preset" in set_data:  # the preset picks the lowest layer; it cannot be an override
                problems.append(Problem("the preset cannot be set with --set (it would be ignored)",
                                        f"--set preset={set_data.pop('preset')}", "use --preset NAME"))
            layers.append(Layer(Source(4, "--set"), set_data))
        except UserError as err:
            problems += err.problems
    if problems:
        raise UserError(problems)
    return layers, normalize(chosen) if chosen else None


def speedup_layers(env: dict[str, str]) -> list[Layer]:
    """One layer per DSTRAIN_<KEY> variable set in `env` for a key of the `speedups:` section: on/off
    (1/0, true/false, yes/no) as a boolean, a number for the change's tuning number, anything else as
    written (the schema then says what it takes)."""
    from dstrain.config.schema import SpeedupsConfig

    layers = []
    for key in SpeedupsConfig.model_fields:
        name = ENV_SPEEDUP_PREFIX + key.upper()
        raw = env.get(name)
        if raw is None or not raw.strip():
            continue
        value: Any = raw.strip()
        on = switch(env, name)
        data: dict[str, Any] = {}
        if on is not None:
            value = on
        elif value.isdigit() and key in ENV_SPEEDUP_NUMBERS:
            data[ENV_SPEEDUP_NUMBERS[key]] = int(value)
            value = True
        elif value.isdigit():
            value = int(value)
        data[key] = value
        layers.append(Layer(Source(3, f"{name}={raw.strip()}"), {"speedups": data}))
    return layers


def merge(layers: list[Layer]) -> Merged:
    """Deep-merge the layers in order, recording the source of every leaf."""
    merged = Merged()
    for layer in layers:
        merged.warnings += layer.warnings
        if layer.replaces_deepspeed:
            merged.data.pop("deepspeed", None)
            merged.sources = {k: v for k, v in merged.sources.items()
                              if not (k == "deepspeed" or k.startswith("deepspeed."))}
        _merge_into(merged, merged.data, copy.deepcopy(layer.data), layer.source, "")
    return merged


def _merge_into(merged: Merged, target: dict, incoming: dict, source: Source, prefix: str) -> None:
    for key, value in incoming.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            # Key by key; an empty mapping ("deepspeed: {}") changes nothing rather than wiping the section.
            _merge_into(merged, target[key], value, source, path + ".")
            continue
        # A whole value replaced: forget the sources of whatever was below it.
        merged.sources = {k: v for k, v in merged.sources.items() if not k.startswith(path + ".")}
        target[key] = value
        if isinstance(value, dict) and value:
            _record(merged, value, source, path + ".")
        else:
            merged.sources[path] = source


def _record(merged: Merged, value: dict, source: Source, prefix: str) -> None:
    for key, sub in value.items():
        if isinstance(sub, dict) and sub:
            _record(merged, sub, source, f"{prefix}{key}.")
        else:
            merged.sources[f"{prefix}{key}"] = source


def get_path(data: dict, path: str, default: Any = None) -> Any:
    """Value at a dotted path, or `default` if any part is missing."""
    node: Any = data
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def set_path(data: dict, path: str, value: Any) -> None:
    """Set a dotted path, creating dicts on the way."""
    parts = path.split(".")
    node = data
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[parts[-1]] = value


def flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; empty dicts stay as leaves."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, path + "."))
        else:
            out[path] = value
    return out
