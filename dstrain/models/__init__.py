"""Model construction: the built-in GPT or a user's entry point ("package.module:function").

The protocol for a user model (docs/your-model-and-data.md): the function, called with
model.kwargs, returns an nn.Module whose forward takes one batch (exactly what the data source
yields, moved to the device) and returns the loss as a scalar tensor.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from dstrain.config.schema import RunConfig
from dstrain.entrypoints import call_entry_point, load_entry_point
from dstrain.errors import UserError


def model_builder(config: RunConfig) -> Callable[[], nn.Module]:
    """A zero-argument function that builds the configured model (called inside zero.Init for stage 3)."""
    m = config.model
    if m.name == "gpt":
        from dstrain.models.gpt import GPT
        return lambda: GPT(m.vocab_size, config.data.seq_len, m.d_model, m.n_layer, m.n_head, m.dropout)
    factory = load_entry_point(m.name, "model.name")

    def build() -> nn.Module:
        model = call_entry_point(factory, m.name, "model.name", "model.kwargs", m.kwargs)
        if not isinstance(model, nn.Module):
            raise UserError.single(f"{m.name} returned {type(model).__name__}, not a torch nn.Module", "model.name",
                                   "return the module itself, e.g. `return MyModel(**kwargs)`")
        model.register_forward_hook(_check_loss(m.name))
        return model

    return build


def _check_loss(name: str):
    """A forward hook: the protocol's one rule, that forward returns the loss, checked where it is broken."""
    def hook(_module, _args, output):
        if isinstance(output, torch.Tensor) and output.dim() == 0 and output.is_floating_point():
            return None
        got = (f"a tensor of shape {tuple(output.shape)}" if isinstance(output, torch.Tensor)
               else type(output).__name__)
        hint = (" (a Hugging Face output: return `outputs.loss`)" if hasattr(output, "loss") else "")
        raise UserError.single(f"the model's forward returned {got}{hint}, not the loss", f"model.name: {name}",
                               "forward(batch) must return a scalar floating-point loss tensor, "
                               "e.g. `return F.cross_entropy(logits.flatten(0, 1), targets.flatten())`")
    return hook


def build_model(config: RunConfig, ds_config: dict, device: torch.device) -> nn.Module:
    """The configured model, built where it will train.

    ZeRO stage 3: inside deepspeed.zero.Init, so that parameters are partitioned as each layer is
    created and a model larger than one device is never whole on one rank. Other stages: directly
    on `device` (torch's default-device context), so a large model is neither initialised by the
    host's slow random number generator nor held whole in host RAM before DeepSpeed moves it.
    """
    import deepspeed
    build = model_builder(config)
    if (ds_config.get("zero_optimization") or {}).get("stage", 0) == 3:
        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            return build()
    with torch.device(device):
        return build()
