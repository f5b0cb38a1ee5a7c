"""Output formats: the dtypes a converted file can hold, safetensors' dtype names, file suffixes, sizes.
"""

from __future__ import annotations

import re

import torch

from dstrain.errors import UserError


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


from dstrain.models.weights import SAFETENSORS_DTYPES  # noqa: F401 (defined with the loader that reads them)


TORCH_SUFFIXES = {".pt", ".pth", ".bin"}


DEFAULT_FILE_NAME = "model.safetensors"


# Large pieces are written in blocks so that casting (e.g. to bf16) needs little extra memory.
BLOCK_ELEMENTS = 1 << 24


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
