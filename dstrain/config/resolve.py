"""From merged layers to a validated RunConfig and the explicit DeepSpeed JSON that will run.

Steps: validate the dstrain sections with the schema; check the deepspeed section key by key
(`deepspeed_checks`: the unknown-key rule, DeepSpeed's bounds, old spellings); link quantities that
have two spellings (train.* and DeepSpeed keys); fill in "auto" as the Hugging Face Trainer does
(here and in `autos`); check the batch arithmetic and the cross-field rules; render the JSON. All
problems are collected and raised together as one UserError; warnings travel in
ResolvedConfig.warnings (printed on stderr by `dstrain config`, and by `dstrain run`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from dstrain.config import autos, deepspeed_checks
from dstrain.config import deepspeed_keys as dsk
from dstrain.config.deepspeed_keys import AUTO
from dstrain.config.fp8 import check_fp8, weight_precision
from dstrain.config.long_context import check_checkpoint_offload, resolve_tiled_mlp
from dstrain.config.layers import (DEFAULT, PRESET_RANK, Merged, Source, collect_layers, flatten, get_path, merge,
                                   set_path)
from dstrain.config.objective import check_objective
from dstrain.config.schema import RunConfig
from dstrain.config.speed_defaults import (check_deepcompile, compile_warnings, render_speed_defaults, resolve_compile,
                                           resolve_loss_chunking)
from dstrain.errors import Problem, UserError

ENV_STRICT = "DSTRAIN_STRICT"

# train.* key <-> DeepSpeed key: one quantity, two spellings.
LINKS = (
    ("train.micro_batch_size", "deepspeed.train_micro_batch_size_per_gpu"),
    ("train.grad_accum_steps", "deepspeed.gradient_accumulation_steps"),
    ("train.global_batch_size", "deepspeed.train_batch_size"),
    ("train.lr", "deepspeed.optimizer.params.lr"),
    ("train.grad_clip", "deepspeed.gradient_clipping"),
    ("train.weight_decay", "deepspeed.optimizer.params.weight_decay"),
    ("train.betas", "deepspeed.optimizer.params.betas"),
    ("train.eps", "deepspeed.optimizer.params.eps"),
)

OPTIMIZER_TYPES = {"adamw": "AdamW", "adam": "Adam", "lamb": "Lamb", "onebitadam": "OneBitAdam",
                   "onebitlamb": "OneBitLamb", "zerooneadam": "ZeroOneAdam"}

SECRET_KEY = re.compile(r"(^|_)(api_?key|token|password|secret)$", re.IGNORECASE)
REDACTED = "<redacted>"

@dataclass
class ResolvedConfig:
    """The outcome of resolution: what will run, and where each setting came from."""

    config: RunConfig
    ds_config: dict[str, Any]
    sources: dict[str, str]
    world_size: int
    accelerator: str
    preset: str | None
    warnings: list[str] = field(default_factory=list)

    @property
    def precision(self) -> str:
        return self.config.train.precision

    def config_hash(self) -> str:
        """Short hash of what a checkpoint's tensors depend on: the model section and the sequence
        length (used to refuse resuming a checkpoint into a different model)."""
        blob = json.dumps([self.config.model.model_dump(mode="json"), self.config.data.seq_len], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def resolve(preset: str | None = None, config_file: Path | None = None, sets: list[str] | None = None,
            world_size: int = 1, accelerator: str = "cuda", env: dict[str, str] | None = None,
            strict: bool | None = None) -> ResolvedConfig:
    """Resolve every layer into the config that will run. `accelerator` is "cuda" or "cpu".
    `strict`: DeepSpeed keys that DeepSpeed ignores are errors, not warnings; None reads DSTRAIN_STRICT."""
    env = dict(os.environ) if env is None else env
    layers, preset_name = collect_layers(preset, config_file, sets or [], env)
    merged = merge(layers)
    merged.preset = preset_name
    if strict is None:
        strict = is_strict(env)
    return resolve_merged(merged, world_size, accelerator, strict)


def is_strict(env: dict[str, str]) -> bool:
    """DSTRAIN_STRICT=1 (or true/yes): what --strict does."""
    return env.get(ENV_STRICT, "").strip().lower() in ("1", "true", "yes", "on")


def resolve_merged(merged: Merged, world_size: int, accelerator: str, strict: bool = False) -> ResolvedConfig:
    problems: list[Problem] = []
    warnings: list[str] = list(merged.warnings)
    ds = merged.data.setdefault("deepspeed", {})
    if not isinstance(ds, dict):
        raise UserError.single("must be a mapping of DeepSpeed keys", _where(merged, "deepspeed"),
                               "write the DeepSpeed settings as keys under 'deepspeed:'")

    ignored = deepspeed_checks.check_keys(merged, problems, warnings, strict)
    written_auto = {f"deepspeed.{path}" for path, value in flatten(ds).items() if value == AUTO}
    notes = _link(merged, problems)
    dstrain_part = {k: v for k, v in merged.data.items() if k != "deepspeed"}
    dstrain_part["preset"] = merged.preset
    config = _validate_schema(dstrain_part, merged, problems, notes)
    if config is None:
        raise UserError(problems)

    precision = _resolve_precision(config, merged, accelerator, problems, notes)
    config.train.precision = precision
    data_parallel = _check_sequence_parallel(config, merged, world_size, problems)
    _resolve_batch(config, merged, data_parallel, problems, notes)
    rendered = _render(config, merged, notes, problems, accelerator, world_size)
    autos.check_autos_left(rendered, merged, ignored, problems)
    _cross_field_checks(rendered, merged, problems, warnings)
    _check_with_deepspeeds_models(rendered, merged, problems)
    resolve_compile(config, rendered, accelerator, notes)
    resolve_loss_chunking(config, merged, notes, problems)
    resolve_tiled_mlp(config, rendered, merged, accelerator, notes, problems)
    check_checkpoint_offload(config, merged, accelerator, problems)
    if config.train.activation_checkpointing == "auto":
        notes["train.activation_checkpointing"] = (
            "auto: each rank decides from its GPU's memory: off where dstrain's estimate of the run without it "
            "is at most half of it, on otherwise (always on for a model other than the built-in GPT)")
    check_deepcompile(config, rendered, merged, accelerator, problems)
    check_fp8(config, rendered, merged, accelerator, problems)
    compile_warnings(config, rendered, merged, warnings)
    _inapplicable_model_keys(config, merged, warnings)
    check_objective(config, merged, problems, warnings, notes)
    _one_gpu_stage3_warning(rendered, merged, world_size, accelerator, warnings)
    _nvme_reuse_warning(rendered, merged, warnings)
    _partial_offload_warning(rendered, merged, warnings)
    if config.train.export_final and not config.train.save_checkpoints:
        problems.append(Problem("export_final converts the last checkpoint, but save_checkpoints is false",
                                _where(merged, "train.export_final"),
                                "set train.save_checkpoints=true, or train.export_final=false"))
    if config.train.save_every_minutes and not config.train.save_checkpoints:
        problems.append(Problem("save_every_minutes asks for time-based checkpoints, but save_checkpoints is false",
                                _where(merged, "train.save_every_minutes"),
                                "set train.save_checkpoints=true, or train.save_every_minutes=null"))
    folder = _model_folder(config.model.name)
    if folder:
        problems.append(Problem(f"{config.model.name} is a folder, not a model name", _where(merged, "model.name"),
                                f"did you mean hf:{config.model.name}? (a Hugging Face model folder is named "
                                f"with the hf: prefix: --set model.name=hf:{config.model.name})"))
    if config.train.export_final in ("hf", "peft") and not config.model.name.startswith("hf:") and not folder:
        problems.append(Problem(f"export_final: {config.train.export_final} writes a Hugging Face folder, which needs "
                                "an \"hf:\" model", _where(merged, "train.export_final"),
                                "use train.export_final=safetensors"))
    if config.train.export_final == "peft" and config.model.lora is None and config.model.name.startswith("hf:"):
        problems.append(Problem("export_final: peft writes LoRA adapters, but model.lora is not set",
                                _where(merged, "train.export_final"),
                                "set model.lora (e.g. --set model.lora={r: 16}), or use train.export_final=hf"))
    _warmup_warning(config, rendered, merged, warnings)
    _profile_warning(config, merged, warnings)
    if problems:
        raise UserError(problems)

    config.deepspeed = rendered
    sources = {}
    for path in flatten(config.model_dump(mode="json")):
        parts = path.split(".")
        noted = [notes[p] for p in (".".join(parts[:end]) for end in range(len(parts), 0, -1)) if p in notes]
        sources[path] = noted[0] if noted else merged.source_of(path).label
    for train_path, ds_path in LINKS:
        if get_path(config.model_dump(), ds_path) is not None:
            sources[ds_path] = f"{_auto(ds_path, written_auto)}follows {train_path} ({sources[train_path]})"
    if "deepspeed.sequence_parallel_size" in sources:
        sources["deepspeed.sequence_parallel_size"] = f"follows train.sequence_parallel ({sources['train.sequence_parallel']})"
    for path in ("deepspeed.fp16.enabled", "deepspeed.bf16.enabled"):
        if path in sources:
            sources[path] = f"{_auto(path, written_auto)}follows train.precision ({sources['train.precision']})"
    sources["preset"] = "--preset / --config" if merged.preset else "default"
    return ResolvedConfig(config, rendered, sources, world_size, accelerator, merged.preset, warnings)


def _auto(path: str, autos: set[str]) -> str:
    """'auto: ' where the user wrote "auto" (the Hugging Face Trainer's rule filled it), else ''."""
    return "auto: " if path in autos else ""


def _where(merged: Merged, path: str) -> str:
    return merged.where(path)


def _validate_schema(data: dict, merged: Merged, problems: list[Problem],
                     notes: dict[str, str]) -> RunConfig | None:
    data = copy.deepcopy(data)
    if get_path(data, "train.global_batch_size") == AUTO:  # "auto" global batch: derived later
        set_path(data, "train.global_batch_size", None)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        for e in err.errors():
            path = ".".join(str(p) for p in e["loc"])
            # A value taken from its DeepSpeed spelling is reported where the user wrote it.
            spelled = next((ds for train, ds in LINKS if train == path and path in notes), path)
            problems.append(Problem(_pydantic_message(e), _where(merged, spelled), _pydantic_fix(e, path)))
        return None


def _pydantic_message(e: dict) -> str:
    if e["type"] == "extra_forbidden":
        return "unknown key"
    value = e.get("input")
    if e["type"] == "value_error" and isinstance(value, dict):  # a check across a section's fields
        return e["msg"].removeprefix("Value error, ")
    shown = repr(value) if not isinstance(value, (dict, list)) else type(value).__name__
    return f"{e['msg']} (got {shown[:80]})"


def _pydantic_fix(e: dict, path: str) -> str:
    from dstrain.config import schema
    parts = path.split(".")
    section = {"model": schema.ModelConfig, "data": schema.DataConfig, "train": schema.TrainConfig,
               "speedups": schema.SpeedupsConfig, "preference": schema.PreferenceConfig}
    model = section.get(parts[0]) if len(parts) == 2 else (schema.RunConfig if len(parts) == 1 else None)
    if e["type"] == "extra_forbidden":
        if model is None:
            return "remove it"
        hint = dsk.suggest(parts[-1], model.model_fields)
        prefix = parts[0] + "." if len(parts) == 2 else ""
        return (hint + " " if hint else "") + "valid keys: " + ", ".join(prefix + f for f in model.model_fields)
    if e["type"] == "value_error" and isinstance(e.get("input"), dict):
        return "change the values the message names so that they agree"
    if model is not None and parts[-1] in model.model_fields:
        return (model.model_fields[parts[-1]].description or "").strip().split("\n")[0]
    return "see `dstrain config --explain` for the valid keys"


def _is_set(value: Any) -> bool:
    return value is not None and value != AUTO


def _link(merged: Merged, problems: list[Problem]) -> dict[str, str]:
    """Make each linked pair agree: the higher layer wins. Returns notes on derived sources."""
    notes: dict[str, str] = {}
    data = merged.data
    if not isinstance(data.get("train", {}), dict):
        return notes  # `train: 5` is reported by the schema; linking would silently replace it
    for train_path, ds_path in LINKS:
        train_value = get_path(data, train_path)
        ds_value = get_path(data, ds_path)
        if not _is_set(ds_value):
            continue
        train_src = merged.source_of(train_path) if _is_set(train_value) else DEFAULT
        ds_src = merged.source_of(ds_path)
        if train_src.rank == ds_src.rank and train_src is not DEFAULT and _differs(train_value, ds_value):
            problems.append(Problem(f"{train_path}={train_value!r} and {ds_path}={ds_value!r} are the same "
                                    "quantity with different values", train_src.label,
                                    f"set only one of {train_path} and {ds_path}"))
            continue
        if ds_src.rank >= train_src.rank:
            set_path(data, train_path, list(ds_value) if isinstance(ds_value, tuple) else ds_value)
            notes[train_path] = f"{ds_src.label} (as {ds_path})"
    return notes


def _differs(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) != list(b)
    try:
        return float(a) != float(b)
    except (TypeError, ValueError):
        return a != b


def _resolve_precision(config: RunConfig, merged: Merged, accelerator: str, problems: list[Problem],
                       notes: dict[str, str]) -> str:
    ds = merged.data["deepspeed"]
    on = {name: _pydantic_true(get_path(ds, f"{name}.enabled")) for name in ("fp16", "bf16")}
    if on["fp16"] and on["bf16"]:
        problems.append(Problem("fp16 and bf16 are both enabled",
                                f"{_where(merged, 'deepspeed.fp16.enabled')} and {_where(merged, 'deepspeed.bf16.enabled')}",
                                "enable one of them, or set train.precision=bf16|fp16|fp32 and drop both"))
        return "fp32"
    ds_choice = "bf16" if on["bf16"] else "fp16" if on["fp16"] else None
    train_src = merged.source_of("train.precision")
    choice = config.train.precision
    if ds_choice:
        ds_src = merged.source_of(f"deepspeed.{ds_choice}.enabled")
        if train_src.rank > ds_src.rank and choice != "auto":
            pass  # train.precision set higher: it wins
        elif choice == "fp8" and ds_choice == "bf16":
            pass  # fp8 trains bf16 weights: DeepSpeed's bf16 section is its own
        elif train_src.rank == ds_src.rank and choice not in ("auto", ds_choice):
            problems.append(Problem(f"train.precision={choice} but deepspeed.{ds_choice}.enabled is true",
                                    ds_src.label, "set only one of them"))
        else:
            choice = ds_choice
            notes["train.precision"] = f"{ds_src.label} (as deepspeed.{ds_choice}.enabled)"
    if choice == "auto":
        choice = "bf16" if accelerator == "cuda" else "fp32"
        notes["train.precision"] = f"auto: {choice} on {accelerator}"
    return choice


def _pydantic_true(value: Any) -> bool:
    """True as DeepSpeed's pydantic models read a bool: also 1 and "true"/"yes"/"on"/"1" in any case."""
    if isinstance(value, str):
        return value.strip().lower() in ("true", "t", "yes", "y", "on", "1")
    return value is True or (type(value) is int and value == 1)


def _check_sequence_parallel(config: RunConfig, merged: Merged, world: int, problems: list[Problem]) -> int:
    """train.sequence_parallel's checks that need no model (the heads are checked with the model, before
    launch: dstrain.models.hf.sequence_parallel_problem). Returns the data-parallel size: the world size
    over which samples are spread, world / sequence_parallel (the world itself where N does not divide it)."""
    sp = config.train.sequence_parallel
    written = (merged.data.get("deepspeed") or {}).get("sequence_parallel_size")
    if written is not None and written != sp:  # DeepSpeed would count world / it data-parallel ranks, no groups
        problems.append(Problem(f"sequence_parallel_size {written!r} differs from train.sequence_parallel {sp}: dstrain "
                                "makes the groups and writes this key itself", _where(merged, "deepspeed.sequence_parallel_size"),
                                f"remove it and set train.sequence_parallel={written}"))
    if sp == 1:
        return world
    where = _where(merged, "train.sequence_parallel")
    if not config.model.name.startswith("hf:"):
        problems.append(Problem(f"sequence parallelism runs DeepSpeed's Ulysses attention inside Hugging Face models; "
                                f"model {config.model.name!r} is not one", where,
                                "use an \"hf:\" model (Llama, Qwen2, Mistral, ...), or train.sequence_parallel=1"))
    if world % sp:
        problems.append(Problem(f"sequence_parallel {sp} does not divide the world size {world}", where,
                                f"use a divisor of {world} (e.g. {max(d for d in range(1, world + 1) if world % d == 0 and d <= sp)}), "
                                f"or run on a multiple of {sp} GPUs (--gpus)"))
    if config.data.seq_len % sp:
        problems.append(Problem(f"data.seq_len {config.data.seq_len} is not divisible by sequence_parallel {sp}: each "
                                "rank holds an equal share of every sample's tokens", _where(merged, "data.seq_len"),
                                f"set data.seq_len to a multiple of {sp} (e.g. {config.data.seq_len // sp * sp or sp})"))
    if config.data.packing is True:
        problems.append(Problem("packed examples are not supported with sequence parallelism: Ulysses' sdpa path "
                                "attends across the examples of a row", _where(merged, "data.packing"),
                                "set data.packing: auto (or false): one padded example per row"))
    attention = config.model.kwargs.get("attn_implementation")
    if attention in ("eager", "paged|eager"):
        problems.append(Problem(f"attn_implementation {attention!r} does not run under DeepSpeed's Ulysses attention "
                                "(it needs a 4D mask of the whole sequence)", _where(merged, "model.kwargs.attn_implementation"),
                                "use sdpa (the default), flash_attention_2 or flex_attention"))
    return world // sp if world % sp == 0 else world


def _resolve_batch(config: RunConfig, merged: Merged, world: int, problems: list[Problem],
                   notes: dict[str, str]) -> None:
    """The batch arithmetic over `world`: the data-parallel size (the world size / train.sequence_parallel)."""
    train = config.train
    micro, accum, glob = train.micro_batch_size, train.grad_accum_steps, train.global_batch_size
    if glob is None:
        train.global_batch_size = micro * accum * world
        ranks = f"world {world}" if train.sequence_parallel == 1 else f"data-parallel ranks {world}"
        notes["train.global_batch_size"] = f"derived: micro {micro} x accum {accum} x {ranks}"
        return
    if micro * accum * world == glob:
        return

    def src(path: str, spelled: str) -> Source:
        return merged.source_of(path) if path not in notes else Source(merged.source_of(spelled).rank, notes[path])

    glob_src = src("train.global_batch_size", "deepspeed.train_batch_size")
    accum_src = src("train.grad_accum_steps", "deepspeed.gradient_accumulation_steps")
    micro_src = src("train.micro_batch_size", "deepspeed.train_micro_batch_size_per_gpu")
    if accum_src.rank < glob_src.rank and glob % (micro * world) == 0:
        train.grad_accum_steps = glob // (micro * world)
        notes["train.grad_accum_steps"] = f"derived: global {glob} / (micro {micro} x world {world})"
        return
    if micro_src.rank < glob_src.rank >= accum_src.rank and glob % (accum * world) == 0:  # as DeepSpeed does
        train.micro_batch_size = glob // (accum * world)
        notes["train.micro_batch_size"] = f"derived: global {glob} / (accum {accum} x world {world})"
        return
    fix = (f"set train.grad_accum_steps={glob // (micro * world)}" if glob % (micro * world) == 0 else
           f"choose a global batch divisible by micro x world = {micro * world}, or leave it unset")
    problems.append(Problem(
        f"global batch {glob} ({glob_src.label}) != micro batch {micro} ({micro_src.label}) x grad accum "
        f"{accum} ({accum_src.label}) x world size {world} = {micro * accum * world}",
        "train.global_batch_size / deepspeed.train_batch_size", fix))


def _render(config: RunConfig, merged: Merged, notes: dict[str, str], problems: list[Problem],
            accelerator: str, world: int) -> dict[str, Any]:
    """The explicit DeepSpeed config: batch keys, precision, optimizer, scheduler; no "auto" left."""
    train = config.train
    ds = copy.deepcopy(merged.data["deepspeed"])
    ds["train_micro_batch_size_per_gpu"] = train.micro_batch_size
    ds["gradient_accumulation_steps"] = train.grad_accum_steps
    ds["train_batch_size"] = train.global_batch_size
    if train.sequence_parallel > 1:  # read by DeepSpeed's config check where no mpu is passed (zero.Init)
        ds["sequence_parallel_size"] = train.sequence_parallel
    ds["gradient_clipping"] = train.grad_clip
    _render_precision(ds, train, notes)
    render_speed_defaults(ds, config, merged, accelerator, world, notes)
    _render_optimizer(ds, train, merged, notes, problems)
    _render_scheduler(ds, train, merged, notes, problems)
    autos.fill_width_autos(ds, config, notes)
    autos.fill_model_autos(ds, notes)

    _integral_floats_to_int(ds)
    for path in _non_finite(ds):
        problems.append(Problem("must be a finite number (JSON has no NaN or Infinity)",
                                _where(merged, f"deepspeed.{path}"), "write a finite number, or remove the key"))
    return ds


def _render_precision(ds: dict[str, Any], train, notes: dict[str, str]) -> None:
    """fp16/bf16 sections (or torch autocast) from train.precision and train.mixed_precision."""
    for name in ("fp16", "bf16"):
        section = ds.get(name) if isinstance(ds.get(name), dict) else {}
        section["enabled"] = weight_precision(train.precision) == name
        ds[name] = section
    if train.precision != "fp16":
        ds.pop("fp16") if ds["fp16"] == {"enabled": False} else None
    if weight_precision(train.precision) != "bf16" and ds.get("bf16") == {"enabled": False}:
        ds.pop("bf16")
    if train.precision in ("bf16", "fp16") and train.mixed_precision == "autocast":
        ds[train.precision]["enabled"] = False  # fp32 weights; torch.autocast does the low-precision math
        if ds[train.precision] == {"enabled": False}:
            ds.pop(train.precision)
        ds["torch_autocast"] = {**(ds.get("torch_autocast") or {}), "enabled": True,
                                "dtype": "bfloat16" if train.precision == "bf16" else "float16"}
        notes["deepspeed.torch_autocast"] = "follows train.mixed_precision=autocast"
    elif weight_precision(train.precision) == "bf16" and "check_grad_overflow" not in ds["bf16"]:
        # DeepSpeed's default checks every gradient for inf/NaN before a bf16 ZeRO-1/2 step: about
        # 13 host-launched kernels per parameter and a host sync, which made a 406M GPT's step
        # host-bound on an H100 (docs/benchmarks.md). bf16 has fp32's range, so overflow is not the
        # fp16 risk the check exists for; as in plain PyTorch, a non-finite loss shows in the log.
        ds["bf16"]["check_grad_overflow"] = False
        notes["deepspeed.bf16.check_grad_overflow"] = "dstrain default: no per-gradient overflow check in bf16"


def _render_optimizer(ds: dict[str, Any], train, merged: Merged, notes: dict[str, str],
                      problems: list[Problem]) -> None:
    """The optimizer section: train.optimizer's, or the user's with train.* filling what it leaves out."""
    adam_params = {"lr": train.lr, "betas": list(train.betas), "eps": train.eps, "weight_decay": train.weight_decay}
    optimizer = ds.get("optimizer")
    if optimizer is None:  # absent, or an empty `optimizer:` in YAML
        ds["optimizer"] = {"type": OPTIMIZER_TYPES[train.optimizer], "params": adam_params}
        notes["deepspeed.optimizer"] = "dstrain: from train.optimizer and train.lr/betas/eps/weight_decay"
    elif not isinstance(optimizer, dict) or not isinstance(optimizer.get("params") or {}, dict):
        bad = "optimizer" if not isinstance(optimizer, dict) else "optimizer.params"
        problems.append(Problem("must be a mapping", _where(merged, f"deepspeed.{bad}"),
                                "e.g. optimizer: {type: AdamW, params: {lr: 3.0e-4}}, "
                                "or remove it to use train.optimizer"))
    else:
        # A partial section (`--set deepspeed.optimizer.params.lr=...`) still names its optimizer:
        # without "type" DeepSpeed would expect a client optimizer and fail at start.
        partial = "type" not in optimizer
        if partial:
            optimizer["type"] = OPTIMIZER_TYPES[train.optimizer]
        params = optimizer["params"] = optimizer.get("params") or {}
        for key, value in adam_params.items():
            # A partial section is train.optimizer with a few keys changed: the rest keep train.*'s
            # values, not DeepSpeed's own defaults (betas 0.999, weight decay 0.01).
            if key in params or key == "lr" or partial:
                params[key] = value


def _render_scheduler(ds: dict[str, Any], train, merged: Merged, notes: dict[str, str],
                      problems: list[Problem]) -> None:
    """The LR schedule: train.schedule's, or the user's with its "auto" params filled."""
    # Not clamped to max_steps: the schedule of the first steps must not depend on how long the run
    # is, or a run extended with --resume would not continue like one that was always that long.
    warmup = max(train.warmup_steps, 1)  # DeepSpeed's schedulers refuse 0; one step of warmup is none
    scheduler_autos = {"warmup_min_lr": 0.0, "warmup_max_lr": train.lr, "warmup_num_steps": warmup,
                       "total_num_steps": train.max_steps}
    if ds.get("scheduler") is None:
        # Warmup starts at lr / warmup, not 0: DeepSpeed's first step would otherwise be wasted at lr 0.
        start = 1.0 / warmup if train.warmup_steps else 1.0
        ours = {**scheduler_autos, "warmup_min_lr": train.lr * start}
        if train.schedule == "cosine":
            ds["scheduler"] = {"type": "WarmupCosineLR", "params": {
                "total_num_steps": train.max_steps, "warmup_num_steps": warmup, "warmup_min_ratio": start,
                "cos_min_ratio": train.min_lr_ratio, "warmup_type": "linear"}}
        elif train.schedule == "linear":
            ds["scheduler"] = {"type": "WarmupDecayLR", "params": {**ours, "warmup_type": "linear"}}
        else:
            ds["scheduler"] = {"type": "WarmupLR", "params": {
                **{k: ours[k] for k in ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps")},
                "warmup_type": "linear"}}
        notes["deepspeed.scheduler"] = "dstrain: from train.schedule, lr, warmup_steps, max_steps"
    elif not isinstance(ds["scheduler"], dict):
        problems.append(Problem("must be a mapping", _where(merged, "deepspeed.scheduler"),
                                "e.g. scheduler: {type: WarmupLR, params: {warmup_num_steps: 100}}, "
                                "or remove it to use train.schedule"))
    elif isinstance(ds["scheduler"].get("params"), dict):
        rules = {"warmup_min_lr": "0, as the Hugging Face Trainer fills it", "warmup_max_lr": "train.lr",
                 "warmup_num_steps": "train.warmup_steps (at least 1)", "total_num_steps": "train.max_steps"}
        for key, value in ds["scheduler"]["params"].items():
            if value == AUTO and key in scheduler_autos:
                ds["scheduler"]["params"][key] = scheduler_autos[key]
                notes[f"deepspeed.scheduler.params.{key}"] = f"auto: {rules[key]}"


def _non_finite(node: Any, path: str = "") -> list[str]:
    """Key paths of NaN/Infinity values, which `json.dumps` would write as invalid JSON."""
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in _non_finite(v, f"{path}.{k}" if path else str(k))]
    if isinstance(node, list):
        return [p for i, v in enumerate(node) for p in _non_finite(v, f"{path}[{i}]")]
    return [path] if isinstance(node, float) and not math.isfinite(node) else []


def _integral_floats_to_int(node: dict) -> None:
    """JSON/YAML give 1e9 as a float; DeepSpeed's sizes are element counts, so write them as ints."""
    for key, value in node.items():
        if isinstance(value, dict):
            _integral_floats_to_int(value)
        elif isinstance(value, float) and value.is_integer() and abs(value) >= 1000:
            node[key] = int(value)


def _model_folder(name: str) -> bool:
    """model.name names a local folder without the hf: prefix (it would be read as an entry point)."""
    if name == "gpt" or name.startswith("hf:") or (":" in name and not name.startswith(("/", ".", "~"))):
        return False
    return Path(name).expanduser().is_dir()


def _warmup_warning(config: RunConfig, ds: dict[str, Any], merged: Merged, warnings: list[str]) -> None:
    """A warmup as long as the run: the learning rate never reaches train.lr, which no error would show."""
    scheduler = ds.get("scheduler") if isinstance(ds.get("scheduler"), dict) else {}
    warmup = (scheduler.get("params") or {}).get("warmup_num_steps")
    steps = config.train.max_steps
    if isinstance(warmup, int) and warmup > 1 and warmup >= steps:
        key = "train.warmup_steps" if warmup == config.train.warmup_steps else "deepspeed.scheduler.params.warmup_num_steps"
        warnings.append(f"{_where(merged, key)}: warmup of {warmup} steps >= train.max_steps "
                        f"({steps}): the learning rate never reaches train.lr (it ends at {min(steps, warmup) / warmup:.0%} "
                        f"of it); set {key} below max_steps, e.g. --set {key}={steps // 10}")


def _profile_warning(config: RunConfig, merged: Merged, warnings: list[str]) -> None:
    """A profile window the run never reaches: profiling was asked for and nothing would be written."""
    profile, steps = config.profile, config.train.max_steps
    if profile.steps and profile.start_after >= steps:
        warnings.append(f"{_where(merged, 'profile.start_after')}: profiling starts after {profile.start_after} "
                        f"steps but the run trains {steps} (train.max_steps): nothing would be profiled; "
                        f"set --set profile.start_after={max(0, steps - profile.steps)}")


GPT_ONLY_KEYS = ("n_layer", "n_head", "d_model", "dropout")  # the built-in GPT's shape; other models bring theirs


def _inapplicable_model_keys(config: RunConfig, merged: Merged, warnings: list[str]) -> None:
    """Model keys the user set that the chosen model never reads: silently ignored, they would look applied."""
    name = config.model.name
    user_set = [key for key in GPT_ONLY_KEYS if merged.source_of(f"model.{key}").rank > PRESET_RANK]
    if name != "gpt":
        kind = "an \"hf:\" model brings its own (its config.json)" if name.startswith("hf:") else \
            "a model entry point gets model.kwargs alone"
        for key in user_set:
            warnings.append(f"{_where(merged, f'model.{key}')}: applies to the built-in GPT only and is ignored for "
                            f"model.name={name!r} ({kind}); remove it" +
                            ("" if name.startswith("hf:") else ", or pass it in model.kwargs"))
    elif config.model.kwargs and merged.source_of("model.kwargs").rank > PRESET_RANK:
        warnings.append(f"{_where(merged, 'model.kwargs')}: ignored for the built-in GPT (model.name=gpt), which reads "
                        "model.n_layer, n_head, d_model, vocab_size and dropout; remove it")


def _one_gpu_stage3_warning(ds: dict[str, Any], merged: Merged, world: int, accelerator: str,
                            warnings: list[str]) -> None:
    """Stage 3 on one GPU shards nothing but still pays its gather hooks (docs/benchmarks.md, finding 16)."""
    zero = ds.get("zero_optimization")
    if world != 1 or accelerator != "cuda" or not isinstance(zero, dict) or zero.get("stage") != 3:
        return
    if (zero.get("offload_param") or {}).get("device", "none") != "none":
        return  # parameter offload is stage 3's alone: there it is the point
    warnings.append(f"{_where(merged, 'deepspeed.zero_optimization.stage')}: ZeRO stage 3 on one GPU partitions "
                    "nothing (one rank holds every shard) and measured 0.75-0.98 of plain PyTorch's speed on a 406M "
                    "GPT (the host's speed decides), 0.95-1.00 on a 913M and a 1.3B, against "
                    "stage 2's 0.99-1.03; use stage2 (or stage2_offload if it does not fit: "
                    "`dstrain estimate` compares them)")


def _nvme_reuse_warning(ds: dict[str, Any], merged: Merged, warnings: list[str]) -> None:
    """With parameters on NVMe, each parameter kept for reuse holds one of offload_param.buffer_count swap
    buffers; DeepSpeed 0.19.8 ran out of them at step 2 of a 1.3B GPT (docs/benchmarks.md, finding 23)."""
    zero = ds.get("zero_optimization")
    if not isinstance(zero, dict) or zero.get("stage") != 3:
        return
    if (zero.get("offload_param") or {}).get("device") != "nvme":
        return
    distance = zero.get("stage3_max_reuse_distance", 1_000_000_000)  # DeepSpeed's default when unset
    if isinstance(distance, (int, float)) and distance > 0:
        warnings.append(f"{_where(merged, 'deepspeed.zero_optimization.stage3_max_reuse_distance')}: "
                        f"{distance:,.0f} with parameters on NVMe keeps used parameters in the NVMe swap buffers; "
                        "DeepSpeed 0.19.8 failed with 'Not enough buffers 0 for swapping 1' once a model had more "
                        "than offload_param.max_in_cpu parameters; set it to 0 (as the stage3_nvme preset does)")


def _partial_offload_warning(ds: dict[str, Any], merged: Merged, warnings: list[str]) -> None:
    """offload_optimizer.ratio < 1 (ZeRO-3 then steps the other share of its sub-groups on the GPU): in
    DeepSpeed 0.19.8 that share goes through a second optimizer whose learning rate the scheduler never sets
    and whose states no checkpoint holds, and it measured 4-5x slower than full offload (docs/benchmarks.md,
    finding 25)."""
    zero = ds.get("zero_optimization")
    if not isinstance(zero, dict) or zero.get("stage") != 3:
        return
    section = zero.get("offload_optimizer")
    if not isinstance(section, dict) or section.get("device") != "cpu":
        return
    ratio = section.get("ratio", 1.0)
    if isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and ratio < 1:
        warnings.append(f"{_where(merged, 'deepspeed.zero_optimization.offload_optimizer.ratio')}: {ratio} steps "
                        "part of the optimizer on the GPU with a second optimizer that DeepSpeed 0.19.8 never gives "
                        "the scheduler's learning rate and leaves out of checkpoints (a resume restarts its Adam "
                        "states); it measured 4-5x slower than full offload; remove the key (ratio 1)")


def _check_with_deepspeeds_models(ds: dict[str, Any], merged: Merged, problems: list[Problem]) -> None:
    """DeepSpeed's own config models on the rendered JSON, so `config` gives `run`'s verdict (values and
    types: what the checks above read from DeepSpeed's source cannot see). A key already reported keeps
    dstrain's message alone."""
    from dstrain.config import deepspeed_models
    if not deepspeed_models.available():
        return  # a laptop without DeepSpeed: the source-read checks above are all there is
    reported = {p.where.rsplit(": ", 1)[-1] for p in problems}
    found = deepspeed_models.validate(ds, lambda path: _where(merged, path))
    for problem in found:
        path = problem.where.rsplit(": ", 1)[-1]
        if not any(path == known or path.startswith(known + ".") for known in reported):
            problems.append(problem)
    if problems or found:
        return  # the whole check would repeat them, less precisely
    refused = deepspeed_models.check_whole(ds)
    if refused:
        problems.append(Problem(f"DeepSpeed refuses this config: {refused}", _where(merged, "deepspeed"),
                                "change the key DeepSpeed names (its config documentation lists the values)"))


def _cross_field_checks(ds: dict[str, Any], merged: Merged, problems: list[Problem], warnings: list[str]) -> None:
    zero = ds.get("zero_optimization") or {}
    if not isinstance(zero, dict):
        return
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        problems.append(Problem(f"ZeRO stage must be 0, 1, 2 or 3 (got {stage!r})",
                                _where(merged, "deepspeed.zero_optimization.stage"), "e.g. stage: 2"))
        return
    for part in ("offload_optimizer", "offload_param"):
        section = zero.get(part)
        if section is None:
            continue
        where = _where(merged, f"deepspeed.zero_optimization.{part}")
        if not isinstance(section, dict):
            problems.append(Problem("must be a mapping", where, "e.g. {device: cpu}"))
            continue
        device = section.get("device", "none")
        if device not in ("none", "cpu", "nvme"):
            problems.append(Problem(f"device must be none, cpu or nvme (got {device!r})", where + ".device",
                                    "e.g. device: cpu"))
        if device == "nvme" and not section.get("nvme_path") and (part == "offload_optimizer" or stage == 3):
            problems.append(Problem("NVMe offload needs a path", where + ".nvme_path",
                                    f"--set deepspeed.zero_optimization.{part}.nvme_path=/local_nvme/dstrain"))
        if part == "offload_param" and device != "none" and stage != 3:  # DeepSpeed reads it at stage 3 only
            warnings.append(f"{where}: DeepSpeed ignores it at stage {stage}; use stage 3 to offload parameters "
                            "(or offload_optimizer to move the optimizer states)")
        if part == "offload_optimizer" and device != "none" and stage == 0:
            problems.append(Problem("offload_optimizer needs ZeRO stage 1, 2 or 3", where,
                                    "set deepspeed.zero_optimization.stage=2"))


def redact(value: Any) -> Any:
    """A copy with secrets (API keys, tokens, passwords) replaced, for printing and saving."""
    if isinstance(value, dict):
        return {k: (REDACTED if SECRET_KEY.search(str(k)) and _is_secret_value(v) else redact(v))
                for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    return value


def _is_secret_value(value: Any) -> bool:
    """A filled-in scalar (string or number); null, "" and booleans (e.g. `token: false`) say nothing."""
    return isinstance(value, (str, int, float)) and not isinstance(value, bool) and value != ""
