"""Planning a conversion: every output tensor, its name, shape and dtype, and which shard file holds it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dstrain.errors import UserError
from dstrain.tools.convert.reader import Checkpoint


@dataclass
class Tensor:
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
class Plan:
    tensors: list[Tensor]
    module_sources: list[str]  # sources copied whole from rank 0's saved module
    frozen_sources: dict[str, torch.Size]  # sources in frozen_param_fragments (name -> full shape)
    flat_sources: list[dict[str, torch.Size]]  # per parameter group: sources in the flat fp32 weights
    notes: list[str]


def plan_conversion(checkpoint: Checkpoint, dtype: torch.dtype) -> Plan:
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
        tensors.append(Tensor(name, source, shape, out_dtype, is_param))

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
    return Plan(tensors, module_sources, frozen, flat_sources, notes)


def split_into_shards(tensors: list[Tensor], limit: int | None) -> list[list[Tensor]]:
    """Group tensors into shards of at most LIMIT bytes, in order; a bigger tensor gets its own."""
    if limit is None:
        return [tensors]
    shards: list[list[Tensor]] = [[]]
    size = 0
    for tensor in tensors:
        if shards[-1] and size + tensor.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    return shards
