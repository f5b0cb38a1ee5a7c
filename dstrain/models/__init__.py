"""Model construction: the built-in GPT or a user's entry point ("package.module:function")."""

from __future__ import annotations

from typing import Callable

from torch import nn

from dstrain.config.schema import RunConfig
from dstrain.entrypoints import load_entry_point


def model_builder(config: RunConfig) -> Callable[[], nn.Module]:
    """A zero-argument function that builds the configured model (called inside zero.Init for stage 3)."""
    m = config.model
    if m.name == "gpt":
        from dstrain.models.gpt import GPT
        return lambda: GPT(m.vocab_size, config.data.seq_len, m.d_model, m.n_layer, m.n_head, m.dropout)
    factory = load_entry_point(m.name, "model.name")
    return lambda: factory(**m.kwargs)
