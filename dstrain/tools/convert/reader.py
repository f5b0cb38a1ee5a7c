"""Reading a ZeRO checkpoint directory: find the tag, check it against dstrain's completion mark when it
has one (sizes), check every rank file is there, load files safely.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dstrain.checkpoints import COMPLETE_MARK, check_tag
from dstrain.errors import Problem, UserError


@dataclass
class Checkpoint:
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


def open_checkpoint(checkpoint_dir: Path, tag: str | None) -> Checkpoint:
    tag_dir = _find_tag_dir(checkpoint_dir, tag)
    _refuse_damaged(tag_dir)
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
    states = load(first_file)
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
            states = load(model_files[0])  # rank 0 alone records the tied weights

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

    return Checkpoint(
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


def _refuse_damaged(tag_dir: Path) -> None:
    """A tag dstrain marked complete must still match its mark: a truncated shard would otherwise fail deep
    inside torch.load, or convert a mix of saves. (Plain DeepSpeed checkpoints have no mark.)"""
    if not (tag_dir / COMPLETE_MARK).exists():
        return
    check = check_tag(tag_dir)
    if check.found is not None and check.damaged:
        raise UserError([Problem(f"damaged checkpoint: {name} {problem}", where=str(tag_dir),
                                 fix=f"convert an intact tag (`dstrain checkpoint verify {tag_dir.parent}` "
                                     "lists them), or restore this one from a copy")
                         for name, problem in check.damaged.items()])


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


def load(file: Path) -> dict:
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
    optimizer = load(optim_file).get("optimizer_state_dict", {})
    if "zero_stage" not in optimizer:
        raise UserError.single("not a ZeRO optimizer file: no zero_stage", where=str(optim_file),
                               fix="save the checkpoint again with engine.save_checkpoint")
    return int(optimizer["zero_stage"])


def deepspeed_version() -> str:
    import deepspeed

    return deepspeed.__version__
