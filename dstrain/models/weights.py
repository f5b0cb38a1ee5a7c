"""Loading named tensors from weight files into a built model, at any ZeRO stage, one tensor at a time.

Used for `hf:` models at ZeRO stage 3 (the Hugging Face weights) and for `train.init_from` (any model,
any stage). Files are memory-mapped (safetensors; torch .bin through torch.load(mmap=True)), so no
rank reads more than the tensor it is copying. At stage 3 every parameter is a partition: it is
gathered whole for the moment of the copy (deepspeed.zero.GatheredParameters, modifier_rank=0), only
rank 0 reads the file's values, and DeepSpeed hands each rank its piece when the gather ends. The
peak host memory is then one tensor, not the model.

Strict: every parameter must be loaded (tied weights count once) and every key in the files must
name something in the model; otherwise a UserError names the keys.
"""

from __future__ import annotations

import re
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

from dstrain.errors import Problem, UserError


@dataclass
class StoredTensor:
    """One tensor in a weight file: its key, its shape (read from the header) and how to read its values."""

    key: str
    shape: tuple[int, ...]
    read: Callable[[], torch.Tensor]


@dataclass
class LoadReport:
    loaded: list[str] = field(default_factory=list)  # the model's names that received values
    missing: list[str] = field(default_factory=list)  # parameters/buffers nothing was loaded into
    unexpected: list[str] = field(default_factory=list)  # keys in the files that match nothing
    mismatched: list[str] = field(default_factory=list)  # "key: file shape vs model shape"


def stored_tensors(files: list[Path], stack: ExitStack) -> Iterator[StoredTensor]:
    """Every tensor of FILES in a fixed order (the same on every rank), values read only on demand."""
    for path in files:
        if path.suffix == ".safetensors":
            from safetensors import safe_open
            handle = stack.enter_context(safe_open(str(path), framework="pt"))
            for key in handle.keys():  # sorted by safetensors: identical on every rank
                shape = tuple(handle.get_slice(key).get_shape())
                yield StoredTensor(key, shape, lambda h=handle, k=key: h.get_tensor(k))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            for key in sorted(state):
                yield StoredTensor(key, tuple(state[key].shape), lambda s=state, k=key: s[k])


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """A parameter's whole shape, also when ZeRO-3 holds only a partition of it."""
    return tuple(getattr(param, "ds_shape", param.shape))


def load_into(model: nn.Module, files: list[Path], name_for_key: Callable[[str, set[str]], str | None],
              zero3: bool, ignore_missing: list[str] = (), ignore_unexpected: list[str] = ()) -> LoadReport:
    """Copy the tensors of FILES into MODEL's parameters and persistent buffers.

    `name_for_key(key, model_names)` maps a file key to the model's state_dict name (None: no match).
    With `zero3`, parameters are gathered one at a time and rank 0 copies; buffers (never partitioned)
    are copied on every rank. All ranks must call this with the same files.
    """
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    params = dict(model.named_parameters(remove_duplicate=False))
    persistent = set(model.state_dict().keys())
    buffers = {name: b for name, b in model.named_buffers(remove_duplicate=False) if name in persistent}
    names = set(params) | set(buffers)
    report = LoadReport()
    with ExitStack() as stack, torch.no_grad():
        for stored in stored_tensors(files, stack):
            name = name_for_key(stored.key, names)
            if name is None:
                report.unexpected.append(stored.key)
                continue
            target = params.get(name, buffers.get(name))
            if full_shape(target) != stored.shape:
                report.mismatched.append(f"{stored.key}: {list(stored.shape)} in the file, "
                                         f"{list(full_shape(target))} in the model")
                continue
            if zero3 and name in params and hasattr(target, "ds_id"):
                import deepspeed
                with deepspeed.zero.GatheredParameters([target], modifier_rank=0):
                    if rank == 0:
                        target.data.copy_(stored.read())
            else:
                target.data.copy_(stored.read())
            report.loaded.append(name)
    report.missing = missing_names(model, set(report.loaded))
    report.missing = [n for n in report.missing if not any(re.search(p, n) for p in ignore_missing)]
    report.unexpected = [k for k in report.unexpected if not any(re.search(p, k) for p in ignore_unexpected)]
    return report


def missing_names(model: nn.Module, loaded: set[str]) -> list[str]:
    """Parameters none of whose names (a tied weight has several) is in LOADED, and persistent buffers not in it."""
    persistent = set(model.state_dict().keys())
    buffers = [name for name, _ in model.named_buffers(remove_duplicate=False) if name in persistent]
    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    missing = [names[0] for names in aliases.values() if not loaded.intersection(names)]
    return missing + [name for name in buffers if name not in loaded]


def raise_if_incomplete(report: LoadReport, where: str, fix: str) -> None:
    """A UserError naming the first few missing, unexpected and mismatched keys, if there are any."""
    problems = []
    for label, keys in (("missing from the weights", report.missing), ("not in the model", report.unexpected),
                        ("of another shape", report.mismatched)):
        if keys:
            shown = ", ".join(keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")
            problems.append(Problem(f"{len(keys)} tensor(s) {label}: {shown}", where, fix))
    if problems:
        raise UserError(problems)
