"""Turn a sharded DeepSpeed ZeRO checkpoint into one consolidated weights file.

`convert_checkpoint` reads the files `engine.save_checkpoint(dir, tag=...)` writes and
produces a `.safetensors` (default) or `.pt` file, optionally split into Hugging Face
style shards plus an index. `to_universal` wraps DeepSpeed's own `ds_to_universal` so a
run can resume with a different number of ranks.

What DeepSpeed writes (0.19), one directory per tag under the save directory:

    latest                                  the newest tag, e.g. "global_step2" (no newline)
    <tag>/mp_rank_00_model_states.pt        stages 0-2: model weights in the training dtype,
                                            buffers, param_shapes, shared_params, ...
    <tag>/zero_pp_rank_R_mp_rank_00_model_states.pt   stage 3: one per rank; weights are empty
                                            placeholders, frozen weights are per-rank fragments
    <tag>/[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt   stages 1-3: one per rank, holding that
                                            rank's slice of the flat fp32 master weights
                                            ("bf16_" prefix when training in bf16)

The fp32 master weights carry no names: `param_shapes` (in the model states) lists, per
parameter group and in flattening order, the name and shape of every parameter they hold.
Stages 1-2 concatenate a group's parameters (with `param_alignment_paddings` after each)
and cut the result into one contiguous slice per rank. Stage 3 cuts every parameter into
ceil(numel / ranks) sized pieces and gives piece R of each parameter to rank R.

Memory: the converter never holds the model. It computes where every tensor goes in the
output first, then loads one rank file at a time (memory-mapped) and writes each slice of
it straight to its place in the output file, so the peak stays near one rank's slice of
the fp32 weights.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

import dstrain
from dstrain.errors import Problem, UserError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# safetensors' names for the dtypes a state dict can hold.
_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}

_TORCH_SUFFIXES = {".pt", ".pth", ".bin"}
_DEFAULT_FILE_NAME = "model.safetensors"
# Large pieces are written in blocks so that casting (e.g. to bf16) needs little extra memory.
_BLOCK_ELEMENTS = 1 << 24
_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


@dataclass
class ConversionReport:
    """What `convert_checkpoint` wrote."""

    files: list[Path]  # every file written: the weights file, or the shards then the index
    num_tensors: int  # entries in the state dict (a tied weight counts once per name)
    num_parameters: int  # parameter elements, tied weights counted once, buffers not counted
    total_bytes: int  # bytes of tensor data, as the index's metadata.total_size
    tag: str
    stage: int  # ZeRO stage of the checkpoint
    world_size: int  # data-parallel ranks that saved it
    notes: list[str] = field(default_factory=list)  # things the user should know (approximations)


def convert_checkpoint(
    checkpoint_dir: Path,
    output: Path,
    *,
    tag: str | None = None,
    dtype: str = "fp32",
    max_shard_size: str | int | None = None,
    force: bool = False,
    metadata: dict[str, str] | None = None,
) -> ConversionReport:
    """Consolidate the ZeRO checkpoint in CHECKPOINT_DIR into OUTPUT.

    CHECKPOINT_DIR is a DeepSpeed save directory (with a `latest` file, or pass `tag`) or
    one tag directory inside it. OUTPUT's suffix picks the format: `.safetensors`, or
    `.pt`/`.pth`/`.bin` for torch.save; a path without a suffix is a directory that gets
    `model.safetensors`. Keys are the model's own `state_dict()` keys, so
    `model.load_state_dict(sd, strict=True)` works. Floating-point tensors are cast to
    `dtype`; integer buffers keep theirs.

    With `max_shard_size` (bytes, or a string such as "2GB", "500MiB") the weights are
    split Hugging Face style: `model-00001-of-00003.safetensors` ... next to OUTPUT plus
    `model.safetensors.index.json` (OUTPUT's name + ".index.json"); a model that fits in
    one shard is written as OUTPUT alone. Files are written under temporary names and
    renamed at the end, so a failure leaves nothing behind. Existing files are only
    replaced with `force`.
    """
    problems = []
    if dtype not in DTYPES:
        problems.append(Problem(f"unknown dtype {dtype!r}", where="dtype", fix=f"use one of: {', '.join(DTYPES)}"))
    shard_limit = None
    if max_shard_size is not None:
        try:
            shard_limit = parse_size(max_shard_size)
        except UserError as error:
            problems.extend(error.problems)
    extra_metadata = dict(metadata or {})
    for key, value in extra_metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            problems.append(Problem(f"metadata {key!r}: {value!r} is not a string", where="metadata",
                                    fix="safetensors metadata maps strings to strings; convert the value with str()"))
    if problems:
        raise UserError(problems)

    output = _output_file(Path(output))
    checkpoint = _open_checkpoint(Path(checkpoint_dir), tag)
    plan = _plan(checkpoint, DTYPES[dtype])

    file_metadata = {
        "format": "pt",  # transformers refuses safetensors files without it
        "dstrain_version": dstrain.__version__,
        "deepspeed_version": _deepspeed_version(),
        "checkpoint_deepspeed_version": str(checkpoint.ds_version),
        "tag": checkpoint.tag,
        "global_step": str(checkpoint.global_steps),
        "zero_stage": str(checkpoint.stage),
        "world_size": str(checkpoint.world_size),
        "dtype": dtype,
    }
    clashes = sorted(set(extra_metadata) & set(file_metadata))
    if clashes:
        raise UserError.single(f"metadata keys {clashes} are reserved for dstrain's own metadata", where="metadata",
                               fix="rename those keys")
    file_metadata.update(extra_metadata)

    shards = _split(plan.tensors, shard_limit)
    layout = _file_layout(output, len(shards))
    _refuse_overwrite(layout, force)

    output.parent.mkdir(parents=True, exist_ok=True)
    written = _write(checkpoint, plan, shards, layout, file_metadata)

    total_bytes = sum(t.nbytes for t in plan.tensors)
    unique_params = {t.source: t.numel for t in plan.tensors if t.is_param}
    return ConversionReport(
        files=written,
        num_tensors=len(plan.tensors),
        num_parameters=sum(unique_params.values()),
        total_bytes=total_bytes,
        tag=checkpoint.tag,
        stage=checkpoint.stage,
        world_size=checkpoint.world_size,
        notes=checkpoint.notes + plan.notes,
    )


def to_universal(checkpoint_dir: Path, output_dir: Path, *, tag: str | None = None, force: bool = False) -> Path:
    """Convert a ZeRO checkpoint into a DeepSpeed universal checkpoint; return OUTPUT_DIR.

    Writes OUTPUT_DIR/<tag>/ (through DeepSpeed's `ds_to_universal`) and
    OUTPUT_DIR/latest_universal. A run with any number of ranks resumes from it with
    `{"checkpoint": {"load_universal": true}}` in the DeepSpeed config and
    `engine.load_checkpoint(OUTPUT_DIR)`. Needs ZeRO stage 1, 2 or 3.

    DeepSpeed (0.19) restores only the optimizer's parameters from a universal checkpoint:
    buffers and frozen parameters keep the values the new model was built with.
    """
    from deepspeed.checkpoint import ds_to_universal

    checkpoint = _open_checkpoint(Path(checkpoint_dir), tag)
    if checkpoint.stage == 0:
        raise UserError.single(
            "universal checkpoints are made from ZeRO optimizer shards, and this is a stage 0 checkpoint",
            where=str(checkpoint.tag_dir),
            fix="stage 0 weights need no reshaping: load the checkpoint with any number of ranks, "
            "or export the weights with convert_checkpoint",
        )
    output_dir = Path(output_dir)
    target = output_dir / checkpoint.tag
    if target.exists() and not force:
        raise UserError.single(f"{target} already exists", where=str(target), fix="pass force=True to replace it")

    output_dir.mkdir(parents=True, exist_ok=True)
    # DeepSpeed writes the tag directory plus `latest_universal` next to it: let it do so in
    # a staging directory, then move the finished result in place.
    staging = Path(tempfile.mkdtemp(dir=output_dir, prefix=f".{checkpoint.tag}.", suffix=".tmp"))
    try:
        args = _universal_args(checkpoint.tag_dir, staging / checkpoint.tag)
        try:
            ds_to_universal.main(args)
        except Exception as error:  # DeepSpeed signals unsupported layouts with assorted exceptions
            raise UserError.single(
                f"DeepSpeed's ds_to_universal failed: {type(error).__name__}: {error}",
                where=str(checkpoint.tag_dir),
                fix="check that the checkpoint was saved by a plain ZeRO run (no pipeline/tensor parallelism)",
            ) from error
        if target.exists():
            shutil.rmtree(target)
        (staging / checkpoint.tag).rename(target)
        _write_text_atomically(output_dir / "latest_universal", checkpoint.tag)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return output_dir


def check_not_degenerate(state_dict: dict[str, torch.Tensor], reference: dict[str, torch.Tensor] | None) -> None:
    """Raise UserError if an exported tensor is empty or all zeros where REFERENCE's is not.

    Catches the classic failed export: ZeRO-3 placeholders (shape (0,)) or zero-filled
    buffers saved instead of the weights. Without a reference only empty tensors are
    reported, since zeros are legitimate (fresh biases, step counters).
    """
    problems = []
    for name, tensor in state_dict.items():
        if reference is None:
            if tensor.numel() == 0:
                problems.append(Problem("tensor is empty", where=name, fix="re-export from the checkpoint"))
            continue
        if name not in reference:
            continue
        expected = reference[name]
        if expected.numel() == 0 or not expected.any():
            continue  # the reference is degenerate itself: nothing to compare against
        if tensor.numel() == 0:
            problems.append(Problem(f"tensor is empty, expected shape {tuple(expected.shape)}", where=name,
                                    fix="re-export from the checkpoint; ZeRO-3 weights must be gathered first"))
        elif not tensor.any():
            problems.append(Problem("tensor is all zeros but the reference is not", where=name,
                                    fix="re-export from the checkpoint"))
    if problems:
        raise UserError(problems)


def load_converted(path: Path) -> dict[str, torch.Tensor]:
    """Load what `convert_checkpoint` wrote (a file, an index JSON or a directory) as a state dict."""
    from safetensors.torch import load_file

    path = Path(path)
    if path.is_dir():
        candidates = [path / _DEFAULT_FILE_NAME, path / (_DEFAULT_FILE_NAME + ".index.json")]
        path = next((c for c in candidates if c.exists()), candidates[0])
    if not path.exists():
        raise UserError.single(f"{path} does not exist", where=str(path), fix="pass the file convert wrote")
    if path.name.endswith(".index.json"):
        weight_map = json.loads(path.read_text())["weight_map"]
        files = list(dict.fromkeys(weight_map.values()))
    else:
        files = [path.name]
    state_dict = {}
    for name in files:
        file = path.parent / name
        if file.suffix == ".safetensors":
            state_dict.update(load_file(file))
        else:
            state_dict.update(torch.load(file, map_location="cpu", weights_only=True))
    return state_dict


def parse_size(size: str | int) -> int:
    """Bytes from an int or a string such as "2GB" (10**9), "500MiB" (2**20) or "1000"."""
    if isinstance(size, bool):  # bool is an int subclass; True is not a size
        size = str(size)
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(size))
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _SIZE_UNITS:
            raise UserError.single(f"cannot read shard size {size!r}", where="max_shard_size",
                                   fix='write a number of bytes or a number with a unit, e.g. "2GB" or "500MiB"')
        value = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if value <= 0:
        raise UserError.single(f"shard size must be positive, got {size!r}", where="max_shard_size",
                               fix='e.g. "2GB"')
    return value


# ---------------------------------------------------------------------------------------
# Reading the checkpoint


@dataclass
class _Checkpoint:
    """One tag directory, checked: every rank file is there."""

    tag_dir: Path
    tag: str
    stage: int
    world_size: int
    model_files: list[Path]  # one (stages 0-2) or one per rank (stage 3)
    optim_files: list[Path]  # one per rank; none for stage 0
    states: dict  # rank 0's model states
    ds_version: str
    global_steps: int
    notes: list[str] = field(default_factory=list)


def _open_checkpoint(checkpoint_dir: Path, tag: str | None) -> _Checkpoint:
    tag_dir = _find_tag_dir(checkpoint_dir, tag)
    notes = []

    rank_files = sorted(tag_dir.glob("zero_pp_rank_*_mp_rank_*_model_states.pt"))
    plain_file = tag_dir / "mp_rank_00_model_states.pt"
    partitioned = bool(rank_files)  # stage 3 writes one model states file per rank
    if not partitioned and not plain_file.exists():
        found = sorted(p.name for p in tag_dir.glob("*_model_states.pt"))
        if not found:
            raise UserError.single("missing mp_rank_00_model_states.pt (rank 0 writes it with every save)",
                                   where=str(tag_dir), fix="copy the complete tag directory")
        raise UserError.single(
            f"no mp_rank_00_model_states.pt, only {', '.join(found)}",
            where=str(tag_dir),
            fix="pipeline- and tensor-parallel checkpoints are not supported; convert them with DeepSpeed's tools",
        )
    first_file = plain_file if not partitioned else rank_files[0]
    states = _load(first_file)
    if states.get("module") is None:
        raise UserError.single("the model states hold no module weights (a pipeline-parallel checkpoint?)",
                               where=str(first_file), fix="convert pipeline checkpoints with DeepSpeed's tools")
    if states.get("mp_world_size", 1) != 1:
        raise UserError.single(f"tensor-parallel checkpoint (mp_world_size={states['mp_world_size']})",
                               where=str(first_file),
                               fix="use to_universal, or DeepSpeed's tools for tensor parallelism")
    world_size = int(states.get("dp_world_size", 1))
    expected = f"expected {world_size} ranks (dp_world_size in {first_file.name})"

    model_files = [plain_file]
    if partitioned:
        model_files = [tag_dir / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" for rank in range(world_size)]
        _require_files(model_files, expected)
        if first_file != model_files[0]:
            states = _load(model_files[0])  # rank 0 alone records the tied weights

    optim_files: list[Path] = []
    if states.get("param_shapes") is not None:  # None when ZeRO is off (stage 0)
        prefixes = [p for p in ("zero_pp_rank_", "bf16_zero_pp_rank_") if any(tag_dir.glob(p + "*_optim_states.pt"))]
        if len(prefixes) != 1:
            message = ("both zero_pp_rank_* and bf16_zero_pp_rank_* optimizer files are present" if prefixes
                       else "no *_optim_states.pt files: the ZeRO optimizer shards are missing")
            raise UserError.single(message, where=str(tag_dir), fix=f"{expected}; copy the complete tag directory")
        optim_files = [tag_dir / f"{prefixes[0]}{rank}_mp_rank_00_optim_states.pt" for rank in range(world_size)]
        _require_files(optim_files, expected)
        extra = sorted(set(tag_dir.glob(prefixes[0] + "*_optim_states.pt")) - set(optim_files))
        if extra:
            notes.append(f"ignored {len(extra)} optimizer file(s) beyond the {world_size} ranks of this save "
                         f"(left from an older save?): {', '.join(p.name for p in extra)}")
        stage = _zero_stage(optim_files[0])
        if (stage == 3) != partitioned:
            raise UserError.single(f"the optimizer files say ZeRO stage {stage} but the model states files are "
                                   f"named for stage {'3' if partitioned else '0-2'}", where=str(tag_dir),
                                   fix="the tag directory mixes files from different saves; save again")
    else:
        stage = 0

    return _Checkpoint(
        tag_dir=tag_dir,
        tag=tag_dir.name,
        stage=stage,
        world_size=world_size,
        model_files=model_files,
        optim_files=optim_files,
        states=states,
        ds_version=str(states.get("ds_version", "unknown")),
        global_steps=int(states.get("global_steps", 0)),
        notes=notes,
    )


def _find_tag_dir(checkpoint_dir: Path, tag: str | None) -> Path:
    """The tag directory: CHECKPOINT_DIR itself, CHECKPOINT_DIR/TAG, or the one `latest` names."""
    if not checkpoint_dir.is_dir():
        raise UserError.single(f"{checkpoint_dir} is not a directory", where=str(checkpoint_dir),
                               fix="pass the directory given to engine.save_checkpoint, or a tag directory in it")
    if _is_tag_dir(checkpoint_dir):
        if tag is not None and tag != checkpoint_dir.name:
            raise UserError.single(f"{checkpoint_dir} is already the tag directory {checkpoint_dir.name!r}",
                                   where=str(checkpoint_dir),
                                   fix=f"drop the tag, or pass the parent directory with tag {tag!r}")
        return checkpoint_dir

    tags = sorted((d.name for d in checkpoint_dir.iterdir() if d.is_dir() and _is_tag_dir(d)), key=_natural_key)
    available = ", ".join(tags)
    if tag is None:
        latest = checkpoint_dir / "latest"
        if latest.is_file():
            tag = latest.read_text().strip()
            if tag not in tags:
                raise UserError.single(f"'latest' names tag {tag!r}, which has no checkpoint files", where=str(latest),
                                       fix=f"pass one of the available tags: {available or 'none'}")
        elif tags:
            raise UserError.single("no 'latest' file to choose a tag", where=str(checkpoint_dir),
                                   fix=f"pass a tag; available: {available}")
        else:
            raise UserError.single("not a DeepSpeed checkpoint: no 'latest' file and no *_model_states.pt files",
                                   where=str(checkpoint_dir),
                                   fix="pass the directory given to engine.save_checkpoint")
    elif tag not in tags:
        raise UserError.single(f"unknown tag {tag!r}", where=str(checkpoint_dir),
                               fix=f"pass one of the available tags: {available or 'none (not a checkpoint?)'}")
    return checkpoint_dir / tag


def _is_tag_dir(path: Path) -> bool:
    return any(path.glob("*_model_states.pt")) or any(path.glob("*_optim_states.pt"))


def _natural_key(text: str) -> list:
    """Sort global_step2 before global_step10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def _require_files(files: list[Path], expected: str) -> None:
    missing = [f for f in files if not f.exists()]
    if missing:
        raise UserError([
            Problem(f"missing rank file {f.name}; {expected}", where=str(f.parent),
                    fix="copy the complete tag directory (every rank writes its own file)")
            for f in missing
        ])


def _safe_globals() -> list:
    """Classes DeepSpeed pickles into its checkpoints, allowed for torch.load(weights_only=True).

    - ZeroStageEnum: the `zero_stage` value in ZeRO optimizer files (an int Enum).
    - LossScaler / DynamicLossScaler: the loss scaler object saved in ZeRO optimizer files
      (plain attributes: scale, window, ...).
    - fragment_address: the (numel, start) dataclass in stage 1-2 `param_slice_mappings`.
    None of them runs code on load beyond setting attributes.
    """
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


def _load(file: Path) -> dict:
    """torch.load a DeepSpeed file: memory-mapped (tensors are read only when touched), weights only."""
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            return torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    except FileNotFoundError:
        raise UserError.single(f"missing file {file.name}", where=str(file.parent),
                               fix="copy the complete tag directory") from None
    except Exception as error:
        text = str(error)
        hint = "the file may be truncated or not a DeepSpeed checkpoint; save it again"
        if "Unsupported global" in text:
            found = re.search(r"Unsupported global: GLOBAL (\S+)", text)
            name = found.group(1) if found else "a Python object"
            hint = (f"the file pickles {name}, which is not allowed to load safely (often a client_state "
                    "object passed to save_checkpoint); store plain values (numbers, strings, tensors) instead")
        raise UserError.single(f"cannot read {file.name}: {text.splitlines()[0] if text else type(error).__name__}",
                               where=str(file), fix=hint) from error


def _zero_stage(optim_file: Path) -> int:
    optimizer = _load(optim_file).get("optimizer_state_dict", {})
    if "zero_stage" not in optimizer:
        raise UserError.single("not a ZeRO optimizer file: no zero_stage", where=str(optim_file),
                               fix="save the checkpoint again with engine.save_checkpoint")
    return int(optimizer["zero_stage"])


def _deepspeed_version() -> str:
    import deepspeed

    return deepspeed.__version__


# ---------------------------------------------------------------------------------------
# Planning: every output tensor, and where its data comes from


@dataclass
class _Tensor:
    """One entry of the output state dict."""

    name: str
    source: str  # the tensor its data comes from: its own name, or the weight it is tied to
    shape: tuple[int, ...]
    dtype: torch.dtype  # in the output
    is_param: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass
class _Plan:
    tensors: list[_Tensor]
    module_sources: list[str]  # sources copied whole from rank 0's saved module
    frozen_sources: dict[str, torch.Size]  # sources in frozen_param_fragments (name -> full shape)
    flat_sources: list[dict[str, torch.Size]]  # per parameter group: sources in the flat fp32 weights
    notes: list[str]


def _plan(checkpoint: _Checkpoint, dtype: torch.dtype) -> _Plan:
    states = checkpoint.states
    module = states["module"]
    buffer_names = set(states.get("buffer_names") or [])
    flat_sources = [dict(group) for group in states.get("param_shapes") or []]
    frozen = dict(states.get("frozen_param_shapes") or {})
    shared = dict(states.get("shared_params") or {})
    flat_names = {name: shape for group in flat_sources for name, shape in group.items()}
    notes = []
    # Without ZeRO there is no shared_params record, but torch.save kept tied weights as one
    # storage: the same view of it under two names is one weight.
    first_view: dict[tuple, str] = {}
    for name, value in module.items():
        if isinstance(value, torch.Tensor) and value.numel() and name not in shared:
            view = (value.untyped_storage().data_ptr(), value.storage_offset(), value.shape, value.stride())
            if view in first_view:
                shared[name] = first_view[view]
            else:
                first_view[view] = name

    # Output order follows the model's own state_dict; anything only the optimizer knows goes last.
    names = [name for name in module if isinstance(module[name], torch.Tensor)]
    skipped = [name for name in module if not isinstance(module[name], torch.Tensor)]
    if skipped:
        notes.append(f"skipped non-tensor entries of the state dict: {', '.join(skipped)}")
    names += [name for name in [*flat_names, *frozen, *shared] if name not in module]

    tensors, module_sources = [], []
    for name in names:
        source = shared.get(name, name)
        if source in flat_names:
            shape, is_param = tuple(flat_names[source]), True
        elif source in frozen:
            shape, is_param = tuple(frozen[source]), True
        elif source in module and (checkpoint.stage < 3 or source in buffer_names):
            # Stages 0-2 keep every weight whole in the module states; stage 3 only its buffers.
            shape, is_param = tuple(module[source].shape), source not in buffer_names
            if source not in module_sources:
                module_sources.append(source)
        else:
            raise UserError.single(f"cannot find the data of {name!r} in the checkpoint",
                                   where=str(checkpoint.tag_dir),
                                   fix="the checkpoint is incomplete or from an unsupported DeepSpeed layout")
        source_dtype = module[source].dtype if source in module else torch.float32
        out_dtype = dtype if source_dtype.is_floating_point else source_dtype
        tensors.append(_Tensor(name, source, shape, out_dtype, is_param))

    lowp = {module[s].dtype for s in module_sources if s not in buffer_names and module[s].dtype != torch.float32}
    if checkpoint.stage == 0 and lowp:
        notes.append(f"stage 0 keeps no named fp32 master weights: the weights are the model's own "
                     f"{'/'.join(sorted(str(d).removeprefix('torch.') for d in lowp))} copy")
    elif checkpoint.stage == 1 and any(s not in buffer_names for s in module_sources):
        notes.append("frozen parameters come from the model's training-dtype copy "
                     "(stage 1 saves no fp32 copy of them)")

    # A model wrapped once more (e.g. in DistributedDataParallel) before deepspeed.initialize
    # saves every key under "module."; the bare model does not have it.
    if tensors and all(t.name.startswith("module.") for t in tensors):
        for tensor in tensors:
            tensor.name = tensor.name.removeprefix("module.")
        notes.append("removed the 'module.' prefix shared by every key")
    return _Plan(tensors, module_sources, frozen, flat_sources, notes)


def _split(tensors: list[_Tensor], limit: int | None) -> list[list[_Tensor]]:
    """Group tensors into shards of at most LIMIT bytes, in order; a bigger tensor gets its own."""
    if limit is None:
        return [tensors]
    shards: list[list[_Tensor]] = [[]]
    size = 0
    for tensor in tensors:
        if shards[-1] and size + tensor.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    return shards


# ---------------------------------------------------------------------------------------
# Output files


@dataclass
class _Layout:
    weight_files: list[Path]  # final names, one per shard
    index: Path | None  # only when sharded
    stale: list[Path]  # the other layout's files (single file vs index), removed with force
    torch_format: bool


def _output_file(output: Path) -> Path:
    """OUTPUT as a file path: a directory (or a path without suffix) gets model.safetensors."""
    if output.is_dir() or not output.suffix:
        return output / _DEFAULT_FILE_NAME
    if output.suffix != ".safetensors" and output.suffix not in _TORCH_SUFFIXES:
        raise UserError.single(f"unknown output format {output.suffix!r}", where=str(output),
                               fix="end OUTPUT with .safetensors, or .pt/.pth/.bin for torch.save")
    return output


def _file_layout(output: Path, num_shards: int) -> _Layout:
    index = output.with_name(output.name + ".index.json")
    torch_format = output.suffix in _TORCH_SUFFIXES
    if num_shards == 1:
        return _Layout([output], None, [index], torch_format)
    files = [output.with_name(f"{output.stem}-{i:05d}-of-{num_shards:05d}{output.suffix}")
             for i in range(1, num_shards + 1)]
    return _Layout(files, index, [output], torch_format)


def _refuse_overwrite(layout: _Layout, force: bool) -> None:
    existing = [p for p in [*layout.weight_files, layout.index, *layout.stale] if p is not None and p.exists()]
    if existing and not force:
        raise UserError([
            Problem(f"{p.name} already exists", where=str(p),
                    fix="choose another OUTPUT, or pass force=True to replace it")
            for p in existing
        ])


def _safetensors_header(tensors: list[_Tensor], metadata: dict[str, str]) -> bytes:
    header: dict = {"__metadata__": metadata}
    offset = 0
    for tensor in tensors:
        if tensor.dtype not in _SAFETENSORS_DTYPES:
            raise UserError.single(f"safetensors cannot store {tensor.dtype}", where=tensor.name,
                                   fix="write a .pt file instead")
        header[tensor.name] = {"dtype": _SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                               "data_offsets": [offset, offset + tensor.nbytes]}
        offset += tensor.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # keeps the data 8-byte aligned, as safetensors does
    return len(encoded).to_bytes(8, "little") + encoded


class _Sink:
    """Safetensors files being filled, in any order, with slices of source tensors.

    Every output tensor has a fixed place in a file (the header is written first), so a
    slice can be written as soon as it is read, whichever rank file it came from.
    """

    def __init__(self, plan: _Plan, shards: list[list[_Tensor]], paths: list[Path], metadata: dict[str, str]):
        self.targets: dict[str, list[tuple[int, int, torch.dtype]]] = {}  # source -> (fd, byte offset, dtype)
        self.remaining = {t.source: t.numel for t in plan.tensors}
        self.overflowed: set[str] = set()
        self.fds: list[int] = []
        try:
            for shard, path in zip(shards, paths):
                header = _safetensors_header(shard, metadata)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
                self.fds.append(fd)
                _pwrite_all(fd, header, 0)
                offset = len(header)
                for tensor in shard:
                    self.targets.setdefault(tensor.source, []).append((fd, offset, tensor.dtype))
                    offset += tensor.nbytes
                os.ftruncate(fd, offset)
        except BaseException:
            self.close()
            raise

    def write(self, source: str, start: int, values: torch.Tensor) -> None:
        """Write VALUES (flat) as elements START... of SOURCE, into every tensor that uses it."""
        values = values.reshape(-1)
        for block_start in range(0, values.numel(), _BLOCK_ELEMENTS):
            block = values[block_start:block_start + _BLOCK_ELEMENTS]
            cast: dict[torch.dtype, torch.Tensor] = {}
            for fd, offset, dtype in self.targets[source]:
                if dtype not in cast:
                    cast[dtype] = block.to(dtype).contiguous()
                    overflow = not torch.isfinite(cast[dtype]).all() and torch.isfinite(block).all()
                    if dtype == torch.float16 and overflow:
                        self.overflowed.add(source)
                data = cast[dtype].view(torch.uint8).numpy()
                _pwrite_all(fd, data, offset + (start + block_start) * dtype.itemsize)
        self.remaining[source] -= values.numel()

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def _pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:  # one pwrite moves at most ~2 GiB on Linux
        count = os.pwrite(fd, view, offset)
        view, offset = view[count:], offset + count


def _write(checkpoint: _Checkpoint, plan: _Plan, shards: list[list[_Tensor]], layout: _Layout,
           metadata: dict[str, str]) -> list[Path]:
    """Fill temporary files next to the outputs, then rename them into place."""
    parent = layout.weight_files[0].parent
    temps: list[Path] = []

    def temp_for(final: Path) -> Path:
        temps.append(_new_temp_file(final))
        return temps[-1]

    try:
        # Torch output is filled as safetensors first (that part needs no memory), then
        # rewritten with torch.save one shard at a time.
        raw = [temp_for(f) for f in layout.weight_files]
        sink = _Sink(plan, shards, raw, metadata)
        try:
            _stream(checkpoint, plan, sink.write)
        finally:
            sink.close()
        incomplete = [s for s, left in sink.remaining.items() if left != 0]
        if incomplete:
            raise UserError.single(f"the checkpoint did not hold all the data of {', '.join(incomplete)}",
                                   where=str(checkpoint.tag_dir), fix="the checkpoint is incomplete; save it again")
        if sink.overflowed:
            plan.notes.append(f"values beyond the fp16 range became inf in: {', '.join(sorted(sink.overflowed))}")

        finished = raw
        if layout.torch_format:
            finished = []
            for shard, path, final in zip(shards, raw, layout.weight_files):
                pt_path = temp_for(final)
                torch.save(_read_raw(path, shard), pt_path)
                path.unlink()
                finished.append(pt_path)

        for stale in layout.stale:
            if stale.exists():
                stale.unlink()  # _refuse_overwrite let it through: force is on
        for temp, final in zip(finished, layout.weight_files):
            temp.replace(final)
        written = list(layout.weight_files)
        if layout.index is not None:
            total = sum(t.nbytes for t in plan.tensors)
            index = {
                "metadata": {"total_size": total, **metadata},
                "weight_map": {t.name: f.name for shard, f in zip(shards, layout.weight_files) for t in shard},
            }
            temp = temp_for(layout.index)
            temp.write_text(json.dumps(index, indent=2) + "\n")
            temp.replace(layout.index)  # last, so an index never points at missing shards
            written.append(layout.index)
        return written
    finally:
        for temp in temps:
            temp.unlink(missing_ok=True)


def _read_raw(path: Path, shard: list[_Tensor]) -> dict[str, torch.Tensor]:
    """Read back the tensors of a file written by `_Sink` (plain reads: no second copy via mmap)."""
    state_dict = {}
    with open(path, "rb") as file:
        header_size = int.from_bytes(file.read(8), "little")
        file.seek(8 + header_size)
        for tensor in shard:
            values = torch.empty(tensor.shape, dtype=tensor.dtype)
            if values.numel():
                file.readinto(values.view(-1).view(torch.uint8).numpy())
            state_dict[tensor.name] = values
    return state_dict


def _new_temp_file(final: Path) -> Path:
    """An empty hidden file next to FINAL, created with the usual permissions (unlike mkstemp's 0600)."""
    while True:
        path = final.with_name(f".{final.name}.{secrets.token_hex(4)}.tmp")
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return path
        except FileExistsError:
            continue


def _write_text_atomically(path: Path, text: str) -> None:
    temp = _new_temp_file(path)
    try:
        temp.write_text(text)
        temp.replace(path)
    finally:
        temp.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------
# Streaming: read each rank file once and hand every slice of a tensor to WRITE


Write = Callable[[str, int, torch.Tensor], None]


def _stream(checkpoint: _Checkpoint, plan: _Plan, write: Write) -> None:
    module = checkpoint.states["module"]
    frozen_fragments = checkpoint.states.get("frozen_param_fragments") or {}
    for source in plan.module_sources:
        write(source, 0, module[source])
    if checkpoint.stage in (1, 2):
        for source in plan.frozen_sources:
            write(source, 0, frozen_fragments[source])  # stages 1-2 keep frozen weights whole
        _stream_stage12(checkpoint, plan, write)
    elif checkpoint.stage == 3:
        _stream_stage3(checkpoint, plan, write)


def _stream_stage12(checkpoint: _Checkpoint, plan: _Plan, write: Write) -> None:
    """Each group's parameters, concatenated (with alignment padding), are cut into one slice per rank."""
    paddings = _load(checkpoint.optim_files[0])["optimizer_state_dict"].get("param_alignment_paddings")
    layouts = []  # per group: (name, start, numel) in the group's flat vector
    for group, shapes in enumerate(plan.flat_sources):
        offset, entries = 0, []
        pads = paddings[group] if paddings is not None else [0] * len(shapes)
        for (name, shape), pad in zip(shapes.items(), pads):
            entries.append((name, offset, math.prod(shape)))
            offset += math.prod(shape) + pad
        layouts.append(entries)

    rank_start = [0] * len(layouts)  # where the next rank's slice begins, per group
    for rank, file in enumerate(checkpoint.optim_files):
        slices = _rank_slices(file, "single_partition_of_fp32_groups", checkpoint, rank)
        if len(slices) != len(layouts):
            raise UserError.single(f"{len(slices)} parameter groups in {file.name}, but param_shapes lists "
                                   f"{len(layouts)}", where=str(file),
                                   fix="the tag directory mixes saves; save again")
        for group, flat in enumerate(slices):
            start, end = rank_start[group], rank_start[group] + flat.numel()
            for name, offset, numel in layouts[group]:
                lo, hi = max(start, offset), min(end, offset + numel)
                if lo < hi:
                    write(name, lo - offset, flat[lo - start:hi - start])
            rank_start[group] = end
        del slices  # drops the memory map of this rank's file


def _stream_stage3(checkpoint: _Checkpoint, plan: _Plan, write: Write) -> None:
    """Rank R holds piece R (ceil(numel / ranks) elements) of every parameter, concatenated."""
    world_size = checkpoint.world_size
    entries, offset = [], 0  # (name, start in each rank's concatenated groups, numel, piece size)
    for shapes in plan.flat_sources:
        for name, shape in shapes.items():
            numel = math.prod(shape)
            piece = math.ceil(numel / world_size)
            entries.append((name, offset, numel, piece))
            offset += piece
    expected_total = offset

    for rank, (optim_file, model_file) in enumerate(zip(checkpoint.optim_files, checkpoint.model_files)):
        groups = _rank_slices(optim_file, "fp32_flat_groups", checkpoint, rank)
        total = sum(g.numel() for g in groups)
        if total != expected_total:
            raise UserError.single(
                f"{optim_file.name} holds {total} fp32 elements, the parameter shapes need {expected_total}",
                where=str(optim_file),
                fix="weights offloaded to NVMe are not in the checkpoint files; convert from a run without NVMe "
                "offload, or the tag directory mixes saves",
            )
        for name, start, numel, piece in entries:
            count = min(piece, numel - rank * piece)  # the last pieces are padding
            if count > 0:
                for lo, values in _read_virtual(groups, start, count):
                    write(name, rank * piece + lo, values)
        del groups

        fragments = (_load(model_file).get("frozen_param_fragments") or {}) if plan.frozen_sources else {}
        for name, shape in plan.frozen_sources.items():
            numel = math.prod(shape)
            piece = math.ceil(numel / world_size)
            count = min(piece, numel - rank * piece)
            if count > 0:
                write(name, rank * piece, fragments[name].reshape(-1)[:count])


def _read_virtual(groups: list[torch.Tensor], start: int, count: int) -> Iterator[tuple[int, torch.Tensor]]:
    """Elements START..START+COUNT of GROUPS seen as one concatenated vector, as (offset, slice) pieces."""
    base = 0
    for group in groups:
        lo, hi = max(start, base), min(start + count, base + group.numel())
        if lo < hi:
            yield lo - start, group[lo - base:hi - base]
        base += group.numel()


def _rank_slices(file: Path, key: str, checkpoint: _Checkpoint, rank: int) -> list[torch.Tensor]:
    optimizer = _load(file).get("optimizer_state_dict", {})
    partition_count = optimizer.get("partition_count")
    counts = partition_count if isinstance(partition_count, list) else [partition_count]
    if key not in optimizer or any(int(c) != checkpoint.world_size for c in counts):
        raise UserError.single(f"{file.name} does not belong to this {checkpoint.world_size}-rank stage "
                               f"{checkpoint.stage} save (partition_count={partition_count})", where=str(file),
                               fix="the tag directory mixes files from different saves; save again")
    return [group.reshape(-1) for group in optimizer[key]]


def _universal_args(input_folder: Path, output_folder: Path):
    """The arguments ds_to_universal's command line would build."""
    import argparse

    return argparse.Namespace(
        input_folder=str(input_folder),
        output_folder=str(output_folder),
        num_extract_workers=1,  # in-process and serial: no worker processes to outlive a failure
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        # Plain models carry no universal_checkpoint_info; DeepSpeed then needs it injected.
        inject_missing_state=True,
    )
