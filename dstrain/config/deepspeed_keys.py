"""What DeepSpeed reads in each section of its config, without importing torch or DeepSpeed.

DeepSpeed treats an unknown key in one of two ways, depending on the section:
- sections read by its pydantic config models (zero_optimization, the offload sections, fp16, bf16,
  the monitors, comms_logger, compile, ...) refuse unknown keys: the run stops at start;
- everything else (the top level, activation_checkpointing, aio, flops_profiler, optimizer,
  scheduler, ...) is read with dict lookups: an unknown key is silently ignored.

The names, aliases, deprecations, numeric bounds and defaults of the pydantic models, and the key
constants of the dict-read sections, are read from the installed DeepSpeed's source with `ast`, so
they follow the installed version without importing it (importing it costs torch, and `dstrain
config` must answer at once). `misspelling_of` is the rule that tells a typo of a key DeepSpeed
reads from a foreign key DeepSpeed ignores. Full value validation with DeepSpeed's own models
follows in `deepspeed_models`, in resolution too (`dstrain config` and `run` give one verdict).
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

AUTO = "auto"  # the Hugging Face value "fill this in"; DeepSpeed's pydantic models drop it

# Top-level keys that DeepSpeed 0.19 reads (runtime/config.py, monitor/, profiling/, comm/, ...).
TOP_LEVEL_KEYS = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "optimizer", "scheduler", "fp16", "bf16", "torch_autocast", "amp", "communication_data_type",
    "seq_parallel_communication_data_type", "gradient_clipping", "prescale_gradients",
    "gradient_predivide_factor", "gradient_allreduce_op", "sparse_gradients", "zero_optimization",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "activation_checkpointing",
    "steps_per_print", "wall_clock_breakdown", "dump_state", "memory_breakdown", "flops_profiler",
    "comms_logger", "tensorboard", "wandb", "csv_monitor", "comet", "elasticity", "autotuning",
    "checkpoint", "data_types", "data_efficiency", "curriculum_learning", "compression_training",
    "aio", "pipeline", "dataloader_drop_last", "disable_allgather", "sparse_attention",
    "hybrid_engine", "compile", "weight_quantization", "quantize_training", "eigenvalue",
    "progressive_layer_drop", "graph_harvesting", "timers", "tensor_parallel",
    "sequence_parallel_size", "use_data_before_expert_parallelism", "expert_parallel",
    "nebula", "log_level", "disable_python_gc", "managed_gradient_accumulation", "vocabulary_size",
    "datastates_ckpt", "bfloat16",
})

# Sections parsed by a DeepSpeed pydantic model (extra="forbid"): (source file, class).
MODEL_SECTIONS = {
    "zero_optimization": ("runtime/zero/config.py", "DeepSpeedZeroConfig"),
    "zero_optimization.offload_param": ("runtime/zero/offload_config.py", "DeepSpeedZeroOffloadParamConfig"),
    "zero_optimization.offload_optimizer": ("runtime/zero/offload_config.py", "DeepSpeedZeroOffloadOptimizerConfig"),
    "fp16": ("runtime/precision_config.py", "DeepSpeedFP16Config"),
    "bf16": ("runtime/precision_config.py", "DeepSpeedBF16Config"),
    "tensorboard": ("monitor/config.py", "TensorBoardConfig"),
    "wandb": ("monitor/config.py", "WandbConfig"),
    "csv_monitor": ("monitor/config.py", "CSVConfig"),
    "comet": ("monitor/config.py", "CometConfig"),
    "comms_logger": ("comm/config.py", "CommsLoggerConfig"),
    "compile": ("compile/config.py", "CompileConfig"),
    "hybrid_engine": ("runtime/config.py", "HybridEngineConfig"),
    "timers.throughput": ("utils/config.py", "DeepSpeedThroughputTimerConfig"),
}

# Sections DeepSpeed reads key by key with dict lookups: (source file, prefix of the key constants).
CONSTANT_SECTIONS = {
    "activation_checkpointing": ("runtime/activation_checkpointing/config.py", "ACT_CHKPT_"),
    "aio": ("runtime/swap_tensor/constants.py", "AIO_"),
    "flops_profiler": ("profiling/constants.py", "FLOPS_PROFILER_"),
}

# Dict-read sections whose keys are few and stable (runtime/config.py, runtime/constants.py).
FIXED_SECTIONS = {
    "optimizer": frozenset({"type", "params", "legacy_fusion"}),
    "scheduler": frozenset({"type", "params"}),
    "torch_autocast": frozenset({"enabled", "dtype", "lower_precision_safe_modules"}),
    "timers": frozenset({"throughput"}),
}

# optimizer.params and scheduler.params go to a constructor as keyword arguments: the constructor,
# not DeepSpeed's config, decides which names exist. These are the names of DeepSpeed's own
# optimizers (FusedAdam, DeepSpeedCPUAdam, FusedLamb, OneBitAdam/Lamb, ZeroOneAdam) and torch's.
OPTIMIZER_PARAMS = frozenset({
    "lr", "betas", "eps", "weight_decay", "amsgrad", "bias_correction", "adam_w_mode", "adamw_mode",
    "torch_adam", "fp32_optimizer_states", "set_grad_none", "momentum", "dampening", "nesterov",
    "max_coeff", "min_coeff", "eps_inside_sqrt", "freeze_step", "cuda_aware",
    "comm_backend_name", "coeff_beta", "factor_max", "factor_min", "factor_threshold",
    "var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper", "maximize",
    "foreach", "capturable", "differentiable", "fused", "alpha", "centered", "lr_decay",
    "initial_accumulator_value", "rho",
})
SCHEDULER_EXTRA_PARAMS = frozenset({"cycle_momentum", "last_batch_iteration"})
# Keys DeepSpeed's config reads without complaint but its engine refuses when it builds the optimizer
# (engine.py, _configure_basic_optimizer), each with the fix: found at start, not on every rank later.
REFUSED_AT_BUILD = {
    "optimizer.params": {"max_grad_norm": "remove it: clipping is deepspeed.gradient_clipping (train.grad_clip)"},
}

# British -> American spellings, applied before comparing keys (zero_optimisation, offload_optimiser).
_SPELLINGS = (("isation", "ization"), ("iser", "izer"), ("ising", "izing"), ("ise_", "ize_"),
              ("behaviour", "behavior"), ("colour", "color"), ("centre", "center"))


@dataclass(frozen=True)
class Bound:
    """A numeric bound of a DeepSpeed model field: value `op` limit, op one of ge, gt, le, lt."""

    op: str
    limit: float

    def allows(self, value: float) -> bool:
        return {"ge": value >= self.limit, "gt": value > self.limit,
                "le": value <= self.limit, "lt": value < self.limit}[self.op]

    def describe(self) -> str:
        words = {"ge": "at least", "gt": "greater than", "le": "at most", "lt": "less than"}[self.op]
        return "positive" if (self.op, self.limit) == ("gt", 0) else f"{words} {self.limit:g}"


@dataclass(frozen=True)
class SectionKeys:
    """The keys DeepSpeed reads in one section, and what it does with any other key."""

    path: str  # "" is the top level
    names: frozenset[str]
    refuses_unknown: bool  # a pydantic model with extra="forbid": DeepSpeed stops at start
    reader: str  # who reads it, for messages
    deprecated: dict[str, str] = field(default_factory=dict)
    bounds: dict[str, tuple[Bound, ...]] = field(default_factory=dict)
    defaults: dict[str, Any] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)  # alias -> field name


def suggest(key: str, valid) -> str:
    """'did you mean X?' for a misspelt key, or ''."""
    close = difflib.get_close_matches(key, sorted(valid), n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}?" if close else ""


def _words(key: str) -> str:
    """A key reduced to its words: camelCase split, lower case, one separator, American spelling."""
    text = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", key).lower()
    text = re.sub(r"[\s\-.]+", "_", text).strip("_")
    for british, american in _SPELLINGS:
        text = text.replace(british, american)
    return text


def _edit_distance(a: str, b: str) -> int:
    """Damerau-Levenshtein (optimal string alignment): a swap of two neighbours counts once."""
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        row = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            cost = a[i - 1] != b[j - 1]
            row[j] = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                row[j] = min(row[j], prev2[j - 2] + 1)
        prev2, prev = prev, row
    return prev[len(b)]


def is_comment(key: str) -> bool:
    """JSON has no comments, so people write them as keys: "_comment", "#", "//", "comment"."""
    return key.startswith(("_", "#", "//")) or key.lower() in ("comment", "comments", "description", "note")


def _abbreviates(words: str, name: str) -> bool:
    """gradient_clip for gradient_clipping: the same words, each one the start of the other's."""
    ours, theirs = words.split("_"), name.split("_")
    return (len(ours) == len(theirs) and ours != theirs
            and all(t.startswith(o) and (len(o) >= 3 or o == t) for o, t in zip(ours, theirs)))


def misspelling_of(key: str, valid) -> str | None:
    """The key of `valid` that `key` most likely misspells, or None when it looks like another key.

    A misspelling is the same words in another case, separator or spelling (zero_optimisation,
    train_micro_batch_size_per_GPU, offload-optimizer), the same words cut short (gradient_clip), or
    a small edit distance: 1 for keys of 5 to 9 characters, 2 from 10 on; never for keys of 4 or
    fewer characters, and never when the digits differ (fp16 is not a typo of bf16, nor stage2 of stage3).
    """
    if key in valid or is_comment(key):
        return None
    words = _words(key)
    squashed = words.replace("_", "")
    for name in sorted(valid):
        if _words(name) == words or _words(name).replace("_", "") == squashed:
            return name
    if len(key) <= 4:
        return None
    for name in sorted(valid):
        if _abbreviates(words, _words(name)):
            return name
    allowed = 1 if len(key) < 10 else 2
    best = None
    for name in sorted(valid):
        if re.findall(r"\d+", name) != re.findall(r"\d+", key):
            continue
        distance = _edit_distance(words, _words(name))
        if distance <= allowed and (best is None or distance < best[0]):
            best = (distance, name)
    return best[1] if best else None


def _deepspeed_root() -> Path | None:
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


@functools.cache
def _parse(rel: str) -> ast.Module | None:
    root = _deepspeed_root()
    if root is None:
        return None
    try:
        return ast.parse((root / rel).read_text())
    except (OSError, SyntaxError):
        return None  # an unexpected DeepSpeed layout: DeepSpeed's own models check at run time


def _keyword(call: ast.Call, name: str):
    return next((kw.value for kw in call.keywords if kw.arg == name), None)


def _number(node) -> float | int | None:
    """A literal number, also written as pp_int(5e8) or -1."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "pp_int" and node.args:
        inner = _number(node.args[0])
        return int(inner) if inner is not None else None
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _default(node) -> tuple[bool, Any]:
    """(found, value) of a field's literal default."""
    number = _number(node)
    if number is not None:
        return True, number
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None
    return (True, value) if isinstance(value, (bool, str, type(None))) else (False, None)


def _model_section(path: str, rel: str, class_name: str) -> SectionKeys | None:
    tree = _parse(rel)
    cls = next((n for n in (tree.body if tree else []) if isinstance(n, ast.ClassDef) and n.name == class_name), None)
    if cls is None:
        return None
    names, deprecated, bounds, defaults, aliases = set(), {}, {}, {}, {}
    for stmt in cls.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        name = stmt.target.id
        names.add(name)
        value = stmt.value
        if not isinstance(value, ast.Call) or not (isinstance(value.func, ast.Name) and value.func.id == "Field"):
            if value is not None:
                found, default = _default(value)
                if found:
                    defaults[name] = default
            continue
        alias = _keyword(value, "alias")
        if isinstance(alias, ast.Constant):
            names.add(alias.value)
            aliases[alias.value] = name
        found, default = _default(value.args[0]) if value.args else _default(_keyword(value, "default"))
        if found:
            defaults[name] = default
        field_bounds = tuple(Bound(op, limit) for op in ("ge", "gt", "le", "lt")
                             if (limit := _number(_keyword(value, op))) is not None)
        if field_bounds:
            bounds[name] = field_bounds
        extra = _keyword(value, "json_schema_extra")
        if isinstance(extra, ast.Dict):
            fields = {k.value: v for k, v in zip(extra.keys, extra.values) if isinstance(k, ast.Constant)}
            new = fields.get("new_param")
            if isinstance(fields.get("deprecated"), ast.Constant) and isinstance(new, ast.Constant):
                deprecated[name] = new.value
    return SectionKeys(path, frozenset(names), True, f"DeepSpeed's {class_name}", deprecated, bounds,
                       defaults, aliases)


def _constant_section(path: str, rel: str, prefix: str) -> SectionKeys | None:
    tree = _parse(rel)
    if tree is None:
        return None
    names = set()
    for stmt in tree.body:
        if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
                and stmt.targets[0].id.startswith(prefix) and not stmt.targets[0].id.endswith("_DEFAULT")
                and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)
                and stmt.value.value.isidentifier()):  # not the *_FORMAT help texts
            names.add(stmt.value.value)
    return SectionKeys(path, frozenset(names), False, f"DeepSpeed ({rel})") if names else None


def _param_constants(rel: str) -> frozenset[str]:
    """snake_case string constants of a module: the parameter names (not class names or values like 'log')."""
    tree = _parse(rel)
    return frozenset(stmt.value.value for stmt in (tree.body if tree else [])
                     if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant)
                     and isinstance(stmt.value.value, str) and stmt.value.value.isidentifier()
                     and stmt.value.value.islower() and "_" in stmt.value.value)


@functools.cache
def sections() -> tuple[SectionKeys, ...]:
    """Every section whose keys dstrain checks, outermost first."""
    found = [SectionKeys("", TOP_LEVEL_KEYS, False, "DeepSpeed's top level")]
    for path, (rel, class_name) in MODEL_SECTIONS.items():
        section = _model_section(path, rel, class_name)
        if section is not None:
            found.append(section)
    for path, (rel, prefix) in CONSTANT_SECTIONS.items():
        section = _constant_section(path, rel, prefix)
        if section is not None:
            found.append(section)
    for path, names in FIXED_SECTIONS.items():
        found.append(SectionKeys(path, names, False, "DeepSpeed (runtime/config.py)"))
    found.append(SectionKeys("optimizer.params", OPTIMIZER_PARAMS, False, "the optimizer's constructor"))
    scheduler_params = _param_constants("runtime/lr_schedules.py") | SCHEDULER_EXTRA_PARAMS
    found.append(SectionKeys("scheduler.params", scheduler_params, False, "the scheduler's constructor"))
    return tuple(sorted(found, key=lambda s: s.path.count(".") + bool(s.path)))


def section(path: str) -> SectionKeys | None:
    return next((s for s in sections() if s.path == path), None)


@functools.cache
def removed_keys() -> dict[str, frozenset[str]]:
    """Keys DeepSpeed has removed and refuses outright ("" = top level): from runtime/config.py."""
    tree = _parse("runtime/config.py")
    out = {"": frozenset(), "zero_optimization": frozenset()}
    for stmt in (tree.body if tree else []):
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and isinstance(stmt.value, ast.Dict):
            target = stmt.targets[0] if isinstance(stmt, ast.Assign) else stmt.target
            name = getattr(target, "id", "")
            keys = frozenset(k.value for k in stmt.value.keys if isinstance(k, ast.Constant))
            if name == "_REMOVED_TOP_LEVEL_CONFIG_KEYS":
                out[""] = keys
            elif name == "_REMOVED_ZERO_CONFIG_KEYS":
                out["zero_optimization"] = keys
    return out


def home_of(key: str, elsewhere: str) -> str | None:
    """The one section (other than `elsewhere`) that reads `key`, or None when none or several do."""
    homes = [s.path for s in sections() if key in s.names and s.path != elsewhere and not s.path.endswith("params")]
    return homes[0] if len(homes) == 1 else None


def zero_keys(part: str = "") -> SectionKeys | None:
    """Accepted keys of zero_optimization ("") or one of its offload sub-sections."""
    return section("zero_optimization" + (f".{part}" if part else ""))
