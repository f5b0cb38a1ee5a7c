"""Tiled MLP for "hf:" models (train.tiled_mlp): each decoder layer's MLP runs over the sequence in shards.

At long sequences a layer's MLP holds its intermediate activations (gate, up, their product: about
3 x tokens x intermediate_size values, 4-5x the hidden states) for backward. DeepSpeed's `TiledMLP`
autograd function (deepspeed/runtime/sequence_parallel/ulysses_sp.py, from the ALST work) runs the MLP
shard by shard without keeping them, keeps only its input, and recomputes each shard's MLP in backward:
one shard's intermediate activations are live at a time, for one more MLP forward per step.

The MLP is found generically (each decoder layer's `mlp` attribute, dstrain.models.hf.decoder_blocks),
and only that module instance's forward is replaced: its class's own forward runs on each shard, so any
MLP that maps [..., tokens, hidden] to the same shape row by row works (Llama, Qwen2, Mistral, ...).

ZeRO: TiledMLP marks the MLP's trainable parameters not ready (`ds_grad_is_ready`) until the last shard's
backward, so ZeRO 1-3 reduce each gradient once, whole. At ZeRO-3 dstrain makes each decoder layer a leaf
module (one fetch: dstrain.launcher.preflight._fetch_blocks_whole), so the MLP's weights are gathered once
for all shards in forward and in backward; where layers are not leaf modules (frozen weights: LoRA) each
shard would gather them again and ranks would have to agree on the shard count, so that is refused
(dstrain.config.long_context.resolve_tiled_mlp).
"""

from __future__ import annotations

import math

from torch import nn


def mlp_modules(model: nn.Module) -> list[nn.Module]:
    """Each decoder layer's MLP, in order: its `mlp` attribute where that is a module of a class named *MLP
    (LlamaMLP, Qwen2MLP, GPT2MLP, ...: one tensor in, one out, token by token). Mixture-of-experts blocks
    (Mixtral's, Qwen2-MoE's) are left alone: they route tokens and may return more than one tensor. Empty when
    the model names no decoder-layer class or none of its layers has such an `mlp`."""
    from dstrain.models.hf import decoder_blocks
    found = (getattr(block, "mlp", None) for block in decoder_blocks(model))
    return [mlp for mlp in found if isinstance(mlp, nn.Module) and type(mlp).__name__.upper().endswith("MLP")]


def auto_shards(tokens: int, hidden_size: int) -> int:
    """ALST's shard count: ceil(tokens / hidden_size), so each shard's intermediate activations are about
    as large as the layer's hidden states (tokens x hidden), at least 1."""
    return max(1, math.ceil(tokens / hidden_size))


def hidden_size(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "hidden_size", None)


def tile(mlp: nn.Module, shards: int) -> None:
    """Make this MLP instance run through DeepSpeed's TiledMLP in `shards` shards along the sequence."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP
    whole = type(mlp).forward  # the class's forward, run on one shard at a time
    params = [p for p in mlp.parameters() if p.requires_grad]  # whose gradients ZeRO must reduce once

    def shard_forward(module: nn.Module, x):
        return whole(module, x)

    def forward(x):
        # TiledMLP splits dim -2 (the sequence); torch.chunk makes at most as many shards as tokens
        return TiledMLP.apply(shard_forward, mlp, x, min(shards, max(1, x.shape[-2])), params)

    mlp.forward = forward


def apply(model: nn.Module, shards: int) -> list[nn.Module]:
    """Tile every decoder layer's MLP of `model` (an hf: model, or dstrain's CausalLM around one); the MLPs tiled."""
    mlps = mlp_modules(model)
    for mlp in mlps:
        tile(mlp, shards)
    return mlps
