"""What happens to a built model before DeepSpeed gets it: `train.init_from` (weights from a
consolidated .safetensors, keys checked strictly) and `train.trainable` / `train.frozen` (which
parameters train). Also the same checks on a meta-device model before any rank starts.

Names are the model's own: for "hf:" models without dstrain's wrapper prefix (see hf.own_name),
for the built-in GPT and entry points as in their state_dict.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from pathlib import Path

from torch import nn

from dstrain.config.schema import RunConfig
from dstrain.errors import Problem, UserError


def display_name(config: RunConfig, name: str) -> str:
    """The name patterns are matched against: the model's own name."""
    from dstrain.models.hf import is_hf, own_name
    return own_name(name) if is_hf(config.model.name) else name


def check_patterns(config: RunConfig, model: nn.Module) -> None:
    """Every train.trainable / train.frozen pattern must match at least one parameter."""
    names = [display_name(config, n) for n, _ in model.named_parameters()]
    problems = []
    for key in ("trainable", "frozen"):
        for i, pattern in enumerate(getattr(config.train, key)):
            if not any(fnmatchcase(n, pattern) for n in names):
                problems.append(Problem(f"{pattern!r} matches no parameter", f"train.{key}[{i}]",
                                        f"use fnmatch patterns over the model's names, e.g. {names[0]!r} "
                                        f"or '{names[0].split('.')[0]}.*'" if names else "the model has no parameters"))
    if problems:
        raise UserError(problems)


def apply_freezing(config: RunConfig, model: nn.Module) -> None:
    """requires_grad per train.trainable / train.frozen; unchanged when both are empty (LoRA's own
    freezing of the base weights stays)."""
    t = config.train
    if not t.trainable and not t.frozen:
        return
    check_patterns(config, model)
    for name, param in model.named_parameters():
        own = display_name(config, name)
        if t.trainable:
            param.requires_grad_(any(fnmatchcase(own, p) for p in t.trainable))
        if any(fnmatchcase(own, p) for p in t.frozen):
            param.requires_grad_(False)
    if not any(p.requires_grad for p in model.parameters()):
        raise UserError.single("no parameter is left to train", "train.trainable / train.frozen",
                               "leave at least one parameter trainable")


def init_path(config: RunConfig) -> Path:
    path = Path(config.train.init_from)
    if not path.is_file():
        raise UserError.single(f"{path} is not a file", "train.init_from",
                               "name a .safetensors written by `dstrain convert-checkpoint` or train.export_final")
    if path.suffix != ".safetensors":
        raise UserError.single(f"{path.name} is not a .safetensors file", "train.init_from",
                               "convert the checkpoint with `dstrain convert-checkpoint CKPT OUT.safetensors`")
    return path


def check_init_keys(config: RunConfig, model: nn.Module) -> None:
    """Before launch: the init_from file's keys and shapes against the (meta-device) model's."""
    from safetensors import safe_open

    from dstrain.models.weights import LoadReport, missing_names, raise_if_incomplete
    path = init_path(config)
    with safe_open(str(path), framework="pt") as handle:
        shapes = {k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()}
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    report = LoadReport(unexpected=[k for k in shapes if k not in expected],
                        mismatched=[f"{k}: {list(shapes[k])} in the file, {list(expected[k])} in the model"
                                    for k in shapes if k in expected and shapes[k] != expected[k]])
    report.missing = missing_names(model, {k for k in shapes if k in expected})
    raise_if_incomplete(report, f"train.init_from: {path}", _INIT_FIX)


_INIT_FIX = ("train.init_from must hold exactly this model's weights under its state_dict names, as "
             "`dstrain convert-checkpoint` writes them for the same model config")


def load_init_from(config: RunConfig, model: nn.Module, zero3: bool) -> None:
    """Copy the init_from weights into the built model (ZeRO-3: one gathered tensor at a time)."""
    from dstrain.models.weights import load_into, plain_route, raise_if_incomplete
    path = init_path(config)
    report = load_into(model, [path], plain_route(lambda key, names: key if key in names else None), zero3)
    raise_if_incomplete(report, f"train.init_from: {path}", _INIT_FIX)
