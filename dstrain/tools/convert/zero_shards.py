"""Streaming the fp32 master weights out of ZeRO's per-rank optimizer files, stage 1-2 (one flat slice
per rank) and stage 3 (a piece of every parameter per rank), one rank file at a time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from dstrain.errors import UserError
from dstrain.tools.convert.plan import Plan
from dstrain.tools.convert.reader import Checkpoint, load


Write = Callable[[str, int, torch.Tensor], None]


def stream_master_weights(checkpoint: Checkpoint, plan: Plan, write: Write) -> None:
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


def _stream_stage12(checkpoint: Checkpoint, plan: Plan, write: Write) -> None:
    """Each group's parameters, concatenated (with alignment padding), are cut into one slice per rank."""
    paddings = load(checkpoint.optim_files[0])["optimizer_state_dict"].get("param_alignment_paddings")
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


def _stream_stage3(checkpoint: Checkpoint, plan: Plan, write: Write) -> None:
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

        fragments = (load(model_file).get("frozen_param_fragments") or {}) if plan.frozen_sources else {}
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


def _rank_slices(file: Path, key: str, checkpoint: Checkpoint, rank: int) -> list[torch.Tensor]:
    optimizer = load(file).get("optimizer_state_dict", {})
    partition_count = optimizer.get("partition_count")
    counts = partition_count if isinstance(partition_count, list) else [partition_count]
    if key not in optimizer or any(int(c) != checkpoint.world_size for c in counts):
        raise UserError.single(f"{file.name} does not belong to this {checkpoint.world_size}-rank stage "
                               f"{checkpoint.stage} save (partition_count={partition_count})", where=str(file),
                               fix="the tag directory mixes files from different saves; save again")
    return [group.reshape(-1) for group in optimizer[key]]
