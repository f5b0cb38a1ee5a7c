"""Loading named tensors from weight files into a built model, at any ZeRO stage, one tensor at a time.

Used for `hf:` models at ZeRO stage 3 (the Hugging Face weights) and for `train.init_from` (any model,
any stage). Files are memory-mapped (safetensors; torch .bin through torch.load(mmap=True)), so no
rank reads more than the tensor it is copying. At stage 3 every parameter is a partition: it is
gathered whole for the moment of the copy (deepspeed.zero.GatheredParameters, modifier_rank=0), only
rank 0 reads the file's values, and DeepSpeed hands each rank its piece when the gather ends. The
peak host memory is then one tensor, not the model. Where transformers converts a checkpoint's layout
on load (a mixture-of-experts layer's per-expert tensors fused into one parameter), the tensors of one
converted parameter are read and converted together (dstrain.models.conversion): the peak is that parameter.

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
from dstrain.models.conversion import Group, StoredTensor

# safetensors' names for the dtypes a state dict can hold.
SAFETENSORS_DTYPES = {
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

_SAFETENSORS_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}

# route(stored tensors, the model's names) -> (groups named by the model's names, keys that match nothing)
Router = Callable[[list[StoredTensor], set[str]], tuple[list[Group], list[str]]]


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
                sliced = handle.get_slice(key)
                yield StoredTensor(key, tuple(sliced.get_shape()), lambda h=handle, k=key: h.get_tensor(k),
                                   _SAFETENSORS_DTYPES.get(sliced.get_dtype(), torch.float32))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            for key in sorted(state):
                yield StoredTensor(key, tuple(state[key].shape), lambda s=state, k=key: s[k], state[key].dtype)


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """A parameter's whole shape, also when ZeRO-3 holds only a partition of it."""
    return tuple(getattr(param, "ds_shape", param.shape))


def plain_route(name_for_key: Callable[[str, set[str]], str | None]) -> Router:
    """A Router that loads each stored tensor as it is under `name_for_key(key, model_names)` (None: no match)."""
    def route(stored: list[StoredTensor], names: set[str]) -> tuple[list[Group], list[str]]:
        groups, unexpected = {}, []
        for tensor in stored:
            name = name_for_key(tensor.key, names)
            if name is None or name in groups:
                unexpected.append(tensor.key)
            else:
                groups[name] = Group(name, None, [(tensor.key, tensor)])
        return list(groups.values()), unexpected
    return route


def load_into(model: nn.Module, files: list[Path], route: Router, zero3: bool,
              ignore_missing: list[str] = (), ignore_unexpected: list[str] = ()) -> LoadReport:
    """Copy the tensors of FILES into MODEL's parameters and persistent buffers.

    `route` sorts the stored tensors into Groups named by the model's state_dict names (plain_route: one
    tensor each; dstrain.models.conversion.load_router: transformers' conversions, e.g. one MoE layer's
    experts fused into one parameter). A group's output names and shapes are checked on meta tensors first;
    then with `zero3` its parameters are gathered together and rank 0 reads, converts and copies; buffers
    (never partitioned) are copied on every rank. All ranks must call this with the same files.
    """
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    params = dict(model.named_parameters(remove_duplicate=False))
    persistent = set(model.state_dict().keys())
    buffers = {name: b for name, b in model.named_buffers(remove_duplicate=False) if name in persistent}
    names = set(params) | set(buffers)
    report = LoadReport()
    with ExitStack() as stack, torch.no_grad():
        groups, report.unexpected = route(list(stored_tensors(files, stack)), names)
        for group in groups:
            try:
                shapes = group.shapes(model)
            except (RuntimeError, ValueError, IndexError) as err:  # the tensors do not fit together
                report.mismatched.append(f"{group.target}: transformers' conversion of {len(group.keys)} tensors "
                                         f"({group.keys[0]}, ...) fails: {str(err).splitlines()[0]}")
                continue
            unknown = [name for name in shapes if name not in names]
            if unknown:
                report.unexpected.extend(unknown if group.transform is not None else group.keys)
                continue
            wrong = [name for name, shape in shapes.items() if full_shape(params.get(name, buffers.get(name))) != shape]
            if wrong:
                report.mismatched.extend(f"{name if group.transform is not None else group.keys[0]}: "
                                         f"{list(shapes[name])} in the file"
                                         + (f" (from {len(group.keys)} tensors)" if group.transform is not None else "")
                                         + f", {list(full_shape(params.get(name, buffers.get(name))))} in the model"
                                         for name in wrong)
                continue
            partitioned = [params[name] for name in shapes if zero3 and name in params and hasattr(params[name], "ds_id")]
            if partitioned:
                import deepspeed
                with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=0):
                    if rank == 0:
                        _copy(group.values(model), params, buffers)
                if any(name in buffers for name in shapes):  # buffers live on every rank
                    _copy({n: v for n, v in group.values(model).items() if n in buffers}, params, buffers)
            else:
                _copy(group.values(model), params, buffers)
            report.loaded.extend(shapes)
    report.missing = missing_names(model, set(report.loaded))
    report.missing = [n for n in report.missing if not any(re.search(p, n) for p in ignore_missing)]
    report.unexpected = [k for k in report.unexpected if not any(re.search(p, k) for p in ignore_unexpected)]
    return report


def _copy(values: dict[str, torch.Tensor], params: dict, buffers: dict) -> None:
    for name, value in values.items():
        params.get(name, buffers.get(name)).data.copy_(value)


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
