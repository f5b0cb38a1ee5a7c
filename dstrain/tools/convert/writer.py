"""Writing converted tensors: safetensors or .pt files, shards plus an index, atomically (temporary
file, then rename), each slice written in place as it streams in.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import torch

from dstrain.errors import Problem, UserError
from dstrain.tools.convert.formats import BLOCK_ELEMENTS, DEFAULT_FILE_NAME, SAFETENSORS_DTYPES, TORCH_SUFFIXES
from dstrain.tools.convert.plan import Plan, Tensor
from dstrain.tools.convert.reader import Checkpoint
from dstrain.tools.convert.zero_shards import stream_master_weights


@dataclass
class _Layout:
    weight_files: list[Path]  # final names, one per shard
    index: Path | None  # only when sharded
    stale: list[Path]  # the other layout's files (single file vs index), removed with force
    torch_format: bool


def output_file(output: Path) -> Path:
    """OUTPUT as a file path: a directory (or a path without suffix) gets model.safetensors."""
    if output.is_dir() or not output.suffix:
        return output / DEFAULT_FILE_NAME
    if output.suffix != ".safetensors" and output.suffix not in TORCH_SUFFIXES:
        raise UserError.single(f"unknown output format {output.suffix!r}", where=str(output),
                               fix="end OUTPUT with .safetensors, or .pt/.pth/.bin for torch.save")
    return output


def file_layout(output: Path, num_shards: int) -> _Layout:
    index = output.with_name(output.name + ".index.json")
    torch_format = output.suffix in TORCH_SUFFIXES
    if num_shards == 1:
        return _Layout([output], None, [index], torch_format)
    files = [output.with_name(f"{output.stem}-{i:05d}-of-{num_shards:05d}{output.suffix}")
             for i in range(1, num_shards + 1)]
    return _Layout(files, index, [output], torch_format)


def refuse_overwrite(layout: _Layout, force: bool) -> None:
    existing = [p for p in [*layout.weight_files, layout.index, *layout.stale] if p is not None and p.exists()]
    if existing and not force:
        raise UserError([
            Problem(f"{p.name} already exists", where=str(p),
                    fix="choose another OUTPUT, or pass force=True to replace it")
            for p in existing
        ])


def safetensors_header(tensors: list[Tensor], metadata: dict[str, str]) -> bytes:
    """The length prefix and JSON header of a safetensors file holding TENSORS in order."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for tensor in tensors:
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise UserError.single(f"safetensors cannot store {tensor.dtype}", where=tensor.name,
                                   fix="write a .pt file instead")
        header[tensor.name] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
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

    def __init__(self, plan: Plan, shards: list[list[Tensor]], paths: list[Path], metadata: dict[str, str]):
        self.targets: dict[str, list[tuple[int, int, torch.dtype]]] = {}  # source -> (fd, byte offset, dtype)
        self.remaining = {t.source: t.numel for t in plan.tensors}
        self.overflowed: set[str] = set()
        self.fds: list[int] = []
        try:
            for shard, path in zip(shards, paths):
                header = safetensors_header(shard, metadata)
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
        for block_start in range(0, values.numel(), BLOCK_ELEMENTS):
            block = values[block_start:block_start + BLOCK_ELEMENTS]
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


def write_output(checkpoint: Checkpoint, plan: Plan, shards: list[list[Tensor]], layout: _Layout,
                 metadata: dict[str, str]) -> list[Path]:
    """Fill temporary files next to the outputs, then rename them into place."""
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
            stream_master_weights(checkpoint, plan, sink.write)
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
                stale.unlink()  # refuse_overwrite let it through: force is on
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


def _read_raw(path: Path, shard: list[Tensor]) -> dict[str, torch.Tensor]:
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


def write_text_atomically(path: Path, text: str) -> None:
    temp = _new_temp_file(path)
    try:
        temp.write_text(text)
        temp.replace(path)
    finally:
        temp.unlink(missing_ok=True)
