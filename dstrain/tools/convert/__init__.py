"""`dstrain convert-checkpoint`: turn a sharded DeepSpeed ZeRO checkpoint into one consolidated weights file.

This package: reader.py (the checkpoint directory), plan.py (where every tensor goes), zero_shards.py
(streaming the fp32 master weights out of the rank files), writer.py (safetensors/.pt, shards, index),
formats.py (dtypes and sizes), universal.py (DeepSpeed's universal checkpoint), hf_folder.py (`--format hf`:
a folder transformers' from_pretrained loads), peft_folder.py (`--format peft`: the LoRA adapters alone, a
folder peft's PeftModel.from_pretrained loads on the base model). Offline: it runs in
its own process, never inside the ranks, except `train.export_final` (rank 0, after the last save).

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
from dataclasses import dataclass, field
from pathlib import Path

import torch

import dstrain
from dstrain.errors import Problem, UserError
from dstrain.tools.convert.formats import DEFAULT_FILE_NAME, DTYPES, parse_size  # noqa: F401 - public
from dstrain.tools.convert.plan import plan_conversion, split_into_shards
from dstrain.tools.convert.reader import deepspeed_version, open_checkpoint
from dstrain.tools.convert.universal import to_universal  # noqa: F401 - public
from dstrain.tools.convert.writer import file_layout, output_file, refuse_overwrite, write_output


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

    def summary(self) -> str:
        """What was written, in sentences (what `dstrain convert-checkpoint` prints)."""
        if len(self.files) == 1:
            where = f"wrote {self.files[0]}"
        else:  # the shards, then the index
            where = f"wrote {len(self.files) - 1} shards and their index {self.files[-1]}"
        lines = [f"{where}: {self.num_tensors:,} tensors, {self.num_parameters:,} parameters, "
                 f"{self.total_bytes / 2**20:,.1f} MiB, from {self.tag} (ZeRO stage {self.stage}, "
                 f"saved by {self.world_size} rank{'s' if self.world_size != 1 else ''})."]
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


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
    shard_limit, extra_metadata = _check_options(dtype, max_shard_size, metadata)
    output = output_file(Path(output))
    checkpoint = open_checkpoint(Path(checkpoint_dir), tag)
    plan = plan_conversion(checkpoint, DTYPES[dtype])
    file_metadata = _file_metadata(checkpoint, dtype, extra_metadata)

    shards = split_into_shards(plan.tensors, shard_limit)
    layout = file_layout(output, len(shards))
    refuse_overwrite(layout, force)

    output.parent.mkdir(parents=True, exist_ok=True)
    written = write_output(checkpoint, plan, shards, layout, file_metadata)

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


def _check_options(dtype: str, max_shard_size: str | int | None,
                   metadata: dict[str, str] | None) -> tuple[int | None, dict[str, str]]:
    """(shard size limit in bytes or None, the caller's metadata), every bad option named at once."""
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
    return shard_limit, extra_metadata


def _file_metadata(checkpoint, dtype: str, extra_metadata: dict[str, str]) -> dict[str, str]:
    """What the output file records about its origin, plus the caller's own keys (not dstrain's)."""
    file_metadata = {
        "format": "pt",  # transformers refuses safetensors files without it
        "dstrain_version": dstrain.__version__,
        "deepspeed_version": deepspeed_version(),
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
    return file_metadata


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
        candidates = [path / DEFAULT_FILE_NAME, path / (DEFAULT_FILE_NAME + ".index.json")]
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
