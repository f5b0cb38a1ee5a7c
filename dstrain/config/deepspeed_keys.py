"""Key-level checks of the `deepspeed` section that need neither torch nor DeepSpeed imported.

DeepSpeed's top level silently ignores unknown keys; dstrain rejects them with a suggestion.
Inside `zero_optimization` the valid names (with their aliases and deprecations) are read from
DeepSpeed's own pydantic models by parsing the installed source with `ast`, so they stay in step
with the installed DeepSpeed without importing it (importing it costs torch, and `dstrain config`
must answer at once). Full value validation with DeepSpeed's models happens in `deepspeed_models`.
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path

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
})

# Keys whose value is a size or count that must be positive when given as a number.
POSITIVE_ZERO_KEYS = ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
                      "prefetch_bucket_size", "stage3_max_live_parameters", "max_live_parameters",
                      "sub_group_size", "stage3_max_reuse_distance", "max_reuse_distance")

# Which DeepSpeed model class describes which part of zero_optimization.
_ZERO_MODELS = {
    "": ("runtime/zero/config.py", "DeepSpeedZeroConfig"),
    "offload_param": ("runtime/zero/offload_config.py", "DeepSpeedZeroOffloadParamConfig"),
    "offload_optimizer": ("runtime/zero/offload_config.py", "DeepSpeedZeroOffloadOptimizerConfig"),
}


@dataclass(frozen=True)
class ModelKeys:
    """Names a DeepSpeed config model accepts: field names, aliases, and deprecated -> modern."""

    names: frozenset[str]
    deprecated: dict[str, str]


def suggest(key: str, valid) -> str:
    """'did you mean X?' for a misspelt key, or ''."""
    close = difflib.get_close_matches(key, sorted(valid), n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}?" if close else ""


def _deepspeed_root() -> Path | None:
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _keyword(call: ast.Call, name: str):
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return None


def _class_keys(source: str, class_name: str) -> ModelKeys:
    tree = ast.parse(source)
    cls = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == class_name)
    names: set[str] = set()
    deprecated: dict[str, str] = {}
    for stmt in cls.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        names.add(stmt.target.id)
        if not isinstance(stmt.value, ast.Call):
            continue
        alias = _keyword(stmt.value, "alias")
        if isinstance(alias, ast.Constant):
            names.add(alias.value)
        extra = _keyword(stmt.value, "json_schema_extra")
        if isinstance(extra, ast.Dict):
            fields = {k.value: v for k, v in zip(extra.keys, extra.values) if isinstance(k, ast.Constant)}
            new = fields.get("new_param")
            if isinstance(fields.get("deprecated"), ast.Constant) and isinstance(new, ast.Constant):
                deprecated[stmt.target.id] = new.value
    return ModelKeys(frozenset(names), deprecated)


@functools.cache
def zero_keys(part: str = "") -> ModelKeys | None:
    """Accepted keys of zero_optimization ("") or one of its offload sub-sections, from DeepSpeed's source."""
    root = _deepspeed_root()
    if root is None:
        return None
    rel, class_name = _ZERO_MODELS[part]
    try:
        return _class_keys((root / rel).read_text(), class_name)
    except (OSError, SyntaxError, StopIteration):
        return None  # an unexpected DeepSpeed layout: leave the check to DeepSpeed's models at run time
