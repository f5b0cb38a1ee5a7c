"""transformers' own checkpoint conversions, applied one group of tensors at a time.

transformers 5 keeps some layers in another layout than their published checkpoints: a mixture-of-experts
layer's experts as fused 3-D parameters (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) where
Qwen3-MoE, DeepSeek-V3 and Mixtral checkpoints hold one tensor per expert, and some renamed keys (GPT-NeoX's
embed_out -> lm_head). Its from_pretrained converts when it loads, its save_pretrained converts back when it
saves, both over a whole state dict. dstrain's ZeRO-3 loader and its hf folder export work one group of
tensors at a time (no process holds the whole model), so they use the same transform objects
(WeightRenaming, WeightConverter from transformers' get_model_conversion_mapping) on one group at a time:

- load (`load_router`): every checkpoint key renamed as transformers renames it; the keys one converter
  collects (e.g. all experts.*.gate_proj.weight and experts.*.up_proj.weight of one layer) form one Group,
  whose values are converted when that group is loaded.
- export (`export_groups`): the model's tensors through the reverse of the conversions the source checkpoint
  used (transformers' reverse_transform, as save_pretrained does), so the folder has the source's layout.

A group's output names and shapes are found first on meta tensors, without reading a value, so every rank
agrees on them and the loader can refuse a misfit before any copy. No second, hand-written table: with
transformers 4.x (no conversion mapping) keys are used as they are.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import nn

from dstrain.errors import UserError


@dataclass
class StoredTensor:
    """One tensor in a weight file: its key, its shape and dtype (read from the header) and how to read its
    values."""

    key: str
    shape: tuple[int, ...]
    read: Callable[[], torch.Tensor]
    dtype: torch.dtype = torch.float32


@dataclass
class Group:
    """The stored tensors that make one or more of the other side's tensors: a single tensor under a name
    (transform None), or the tensors a transformers WeightConverter collects for `target`, each with the
    source pattern that collected it."""

    target: str
    transform: Any = None
    sources: list[tuple[str, StoredTensor]] = field(default_factory=list)
    renamings: list = field(default_factory=list)  # export: applied to the converter's output names

    @property
    def keys(self) -> list[str]:
        return [stored.key for _, stored in self.sources]

    def shapes(self, model: nn.Module | None = None) -> dict[str, tuple[int, ...]]:
        """The output names and shapes, computed on meta tensors (nothing read)."""
        values = self._convert(lambda s: torch.empty(s.shape, dtype=s.dtype, device="meta"), model)
        return {name: tuple(value.shape) for name, value in values.items()}

    def values(self, model: nn.Module | None = None,
               read: Callable[[StoredTensor], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The output tensors, read from the files (or by READ) and converted."""
        return self._convert(read or (lambda s: s.read()), model)

    def _convert(self, read: Callable[[StoredTensor], torch.Tensor], model) -> dict[str, torch.Tensor]:
        if self.transform is None:
            return {self.target: read(self.sources[0][1])}
        from transformers.core_model_loading import apply_renamings
        converter = copy.deepcopy(self.transform)  # it collects tensors: a fresh one per conversion
        for pattern, stored in self.sources:
            converter.add_tensor(self.target, stored.key, pattern, lambda s=stored: read(s))
        out = converter.convert(self.target, model=model, config=getattr(model, "config", None))
        return {apply_renamings(name, self.renamings): (value[0] if isinstance(value, list) else value)
                for name, value in out.items()}


def _mapping(model: nn.Module, add_legacy: bool) -> list | None:
    """transformers' conversion mapping for MODEL, or None where this transformers has none (4.x)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        return list(get_model_conversion_mapping(model, add_legacy=add_legacy))
    except (ImportError, AttributeError, TypeError):
        return None


_LOADING_FUNCTIONS = ("rename_source_key", "apply_renamings", "apply_converters")


def _missing_loading_functions() -> list[str]:
    from transformers import core_model_loading
    return [name for name in _LOADING_FUNCTIONS if not hasattr(core_model_loading, name)]


def _converts_its_own_layout(model: nn.Module) -> bool:
    """Whether MODEL's mapping holds more than transformers' legacy renamings (gamma/beta, for checkpoints of
    years ago) and base-model prefix changes: a fused or renamed layer (mixture-of-experts models, GPT-NeoX's
    head), which needs the loading functions."""
    mapping = _mapping(model, add_legacy=False) or []
    try:
        from transformers.core_model_loading import PrefixChange
    except ImportError:
        return bool(mapping)
    return any(not isinstance(m, PrefixChange) for m in mapping)


def _require_loading_functions() -> None:
    """transformers versions that have a conversion mapping but not all the functions that apply it (5.17
    has no apply_renamings) would stop every rank with an ImportError at load: say so instead."""
    import transformers
    missing = _missing_loading_functions()
    if missing:
        raise UserError.single(f"transformers {transformers.__version__} converts this model's checkpoint when it "
                               f"loads it, but has no {', '.join(missing)} (transformers.core_model_loading), "
                               "which dstrain's ZeRO-3 loader applies tensor by tensor", "model.name",
                               "pip install 'transformers>=5.24' (the version this loader is tested with), "
                               "or train at stage 1 or 2")


def _split(mapping: list) -> tuple[list, list]:
    from transformers.core_model_loading import WeightConverter, WeightRenaming
    return ([m for m in mapping if isinstance(m, WeightRenaming)],
            [m for m in mapping if isinstance(m, WeightConverter)])


def _natural(stored: Iterable[StoredTensor]) -> list[StoredTensor]:
    """transformers' key order (experts.2 before experts.10): the order a converter stacks experts in."""
    try:
        from transformers.core_model_loading import dot_natural_key
    except ImportError:
        return list(stored)
    return sorted(stored, key=lambda s: dot_natural_key(s.key))


def load_router(model: nn.Module) -> Callable[[list[StoredTensor], set[str]], tuple[list[Group], list[str]]]:
    """For MODEL: a function that sorts a checkpoint's stored tensors into Groups named by the model's
    own names, as transformers' from_pretrained renames and collects them, plus the keys that match nothing.

    A key is renamed by the mapping's renamings and at most one converter (transformers' rename_source_key),
    the base-model prefix added or removed where the model's names need it; a key the model has under its
    stored name stays as it is."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    mapping = _mapping(model, add_legacy=True)
    if mapping and _missing_loading_functions() and not _converts_its_own_layout(model):
        # transformers 5.17 (no apply_renamings) and a model stored in its own layout (Llama, Qwen2, ...):
        # keys as stored, the prefix handled below; a key that needed a legacy renaming is named as unknown.
        mapping = None
    if mapping:
        _require_loading_functions()
        from transformers.core_model_loading import rename_source_key
        renamings, converters = _split(mapping)
        by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}

    def route(stored: list[StoredTensor], names: set[str]) -> tuple[list[Group], list[str]]:
        known = dict.fromkeys(names, True)
        groups: dict[str, Group] = {}
        unexpected = []
        for tensor in _natural(stored):
            target, pattern = tensor.key, None
            if mapping:
                target, pattern = rename_source_key(tensor.key, renamings, converters, prefix or None, known)
            if target not in names:
                target, pattern = next((c for c in (tensor.key, f"{prefix}.{tensor.key}",
                                                     tensor.key.removeprefix(f"{prefix}.")) if c in names), None), None
            if target is None or (pattern is None and target in groups):
                unexpected.append(tensor.key)
            elif pattern is None:
                groups[target] = Group(target, None, [(tensor.key, tensor)])
            else:
                groups.setdefault(target, Group(target, by_pattern[pattern])).sources.append((pattern, tensor))
        return list(groups.values()), unexpected
    return route


def used_conversions(model: nn.Module, source_keys: list[str] | None) -> list:
    """The conversions of MODEL's mapping (legacy renamings aside, as save_pretrained) that the source
    checkpoint's keys used: those match a key on load. Without the keys, every conversion but prefix changes,
    which is what save_pretrained writes for a model not loaded from a file (the published layout)."""
    mapping = _mapping(model, add_legacy=False)
    if not mapping:
        return []
    if source_keys is None:
        from transformers.core_model_loading import PrefixChange
        return [m for m in mapping if not isinstance(m, PrefixChange)]
    from transformers.core_model_loading import rename_source_key
    renamings, converters = _split(mapping)
    names = dict.fromkeys(model.state_dict().keys(), True)
    for key in source_keys:  # marks the transforms that match (transformers' was_used)
        rename_source_key(key, renamings, converters, getattr(model, "base_model_prefix", None) or None, names)
    return [m for m in mapping if m.was_used()]


def export_groups(model: nn.Module, tensors: list[StoredTensor], source_keys: list[str] | None) -> list[Group]:
    """MODEL's tensors (under the model's names) grouped as save_pretrained would write them: through the
    reverse of the conversions the source checkpoint used (used_conversions), in transformers' order."""
    conversions = used_conversions(model, source_keys)
    if not conversions:
        return [Group(t.key, None, [(t.key, t)]) for t in tensors]
    from transformers.core_model_loading import apply_converters, apply_renamings
    reverse = [conversion.reverse_transform() for conversion in conversions[::-1]]
    renamings, converters = _split(reverse)
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    groups: dict[str, Group] = {}
    for tensor in _natural(tensors):
        target, pattern = apply_converters(tensor.key, converters)
        if pattern is None:
            name = apply_renamings(tensor.key, renamings)
            groups[name] = Group(name, None, [(tensor.key, tensor)])
        else:
            groups.setdefault(target, Group(target, by_pattern[pattern], renamings=renamings)).sources.append(
                (pattern, tensor))
    return list(groups.values())
