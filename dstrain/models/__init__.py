"""Model construction: the built-in GPT, a pretrained Hugging Face model ("hf:...", models/hf.py)
or a user's entry point ("package.module:function"); then train.init_from and freezing (models/setup.py).

The protocol for a user model (docs/your-model-and-data.md): the function, called with
model.kwargs, returns an nn.Module whose forward takes one batch (exactly what the data source
yields, moved to the device) and returns the loss as a scalar tensor.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, NamedTuple

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
        chunk = config.train.loss_chunk_tokens if config.train.loss_chunking is True else None
        return lambda: GPT(m.vocab_size, config.data.seq_len, m.d_model, m.n_layer, m.n_head, m.dropout, chunk)
    from dstrain.models import hf
    if hf.is_hf(m.name):
        return hf.skeleton_builder(config)  # random weights: counting, estimates; build_model loads them
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

    from dstrain.models import hf, setup
    zero3 = (ds_config.get("zero_optimization") or {}).get("stage", 0) == 3
    if hf.is_hf(config.model.name):
        model = hf.build_pretrained(config, ds_config, device)
    elif zero3:
        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = model_builder(config)()
    else:
        with torch.device(device):
            model = model_builder(config)()
    if config.train.init_from:
        setup.load_init_from(config, model, zero3)
    setup.apply_freezing(config, model)
    if config.train.objective != "lm":  # preference objectives: the loss of dstrain.models.preference
        from dstrain.models.preference import attach
        attach(model, config)
    return model


class ModelFacts(NamedTuple):
    """What the pre-launch check learns from the model built on the meta device."""

    params: int         # parameters, tied ones once
    trainable: int      # of which reach the optimizer (LoRA adapters, train.trainable / train.frozen)
    largest: int        # the largest single module's direct parameters
    block_class: str | None  # qualified class of an hf: model's repeated block (its transformer layer)
    loss_chunking: bool = False  # the LM loss runs through the chunked head (train.loss_chunking decided)
    loss_note: str | None = None  # why an hf: model keeps its own loss although chunking was asked
    loss_why: str | None = None  # why an hf: model's loss is chunked or not (train.loss_chunking decided)
    mlps: int = 0  # an hf: model's decoder-layer MLPs that train.tiled_mlp can tile
    block_largest: int = 0  # an hf: model's largest single parameter inside a decoder layer (0: none found)
    block_params: int = 0   # the parameters of all its decoder layers


def check_model(config: RunConfig) -> ModelFacts:
    """Before any rank starts: build the model on the meta device (no memory) and check what can be
    checked there (init_from keys, freezing patterns, an hf: model's tokenizer)."""
    from dstrain.models import hf, setup

    built: list[nn.Module] = []
    build = model_builder(config)
    params, largest = count_model(lambda: built.append(build()) or built[0])
    model = built[0]
    if config.train.init_from:
        setup.check_init_keys(config, model)
    setup.check_patterns(config, model)
    setup.apply_freezing(config, model)  # on the meta model: only to count what trains
    block, mlps, block_largest, block_total = None, 0, 0, 0
    if hf.is_hf(config.model.name):
        hf.check_vocab(config, model.model.config)  # peft's wrapper forwards .config
        sp = config.train.sequence_parallel
        problem = hf.sequence_parallel_problem(model.model.config, sp) if sp > 1 else None
        if problem:
            raise UserError.single(f"sequence_parallel {sp} cannot split model {config.model.name!r}: {problem}",
                                   "train.sequence_parallel", "use a sequence_parallel that divides the attention "
                                   "heads (and the key-value heads, or one they divide)")
        if Path(hf.source_of(config)).is_dir():  # a hub id is downloaded by the ranks, not here
            hf.weight_files(config)
        from dstrain.models.tiled_mlp import mlp_modules
        mlps = len(mlp_modules(model))
        block, block_largest, block_total = decoder_layer_facts(model)
    chunked = getattr(model, "lm_loss", None) is not None
    return ModelFacts(params, trainable_parameters(model), largest, block, chunked, getattr(model, "loss_note", None),
                      getattr(model, "loss_why", None), mlps, block_largest, block_total)


def decoder_layer_facts(model: nn.Module) -> tuple[str | None, int, int]:
    """An hf: model's decoder layers: their qualified class, their largest single parameter and all their
    parameters (what ZeRO-3 keeps whole when dstrain keeps the layers whole)."""
    from dstrain.models import hf
    sizes = [p.numel() for b in hf.decoder_blocks(model) for p in b.parameters()]
    return hf.block_class(model), max(sizes, default=0), sum(sizes)


def model_shape(model, config: RunConfig) -> dict[str, Any]:
    """What the memory estimate needs of a built model (Workload fields): layers, width, heads and
    vocabulary (an hf: model's from its config, the built-in GPT's and an entry point's from model.*),
    the LM loss's tokens per chunk (None: the whole logits), and a mixture-of-experts model's routed
    experts' parameters a token does not run through (inactive_params)."""
    lm_loss = getattr(model, "lm_loss", None)
    m = config.model
    shape = {"n_layer": m.n_layer, "d_model": m.d_model, "n_head": m.n_head, "vocab_size": m.vocab_size,
             "loss_chunk_tokens": lm_loss.chunk if lm_loss is not None else None}
    from dstrain.models.hf import CausalLM
    if isinstance(model, CausalLM):
        hf_config = model.model.config
        for key, names in (("n_layer", ("num_hidden_layers", "n_layer")), ("d_model", ("hidden_size", "n_embd")),
                           ("n_head", ("num_attention_heads", "n_head")), ("vocab_size", ("vocab_size",))):
            value = next((getattr(hf_config, n) for n in names if isinstance(getattr(hf_config, n, None), int)), None)
            if value:
                shape[key] = value
        from dstrain.models.moe import inactive_parameters
        inactive = inactive_parameters(model.model)
        if inactive:  # a mixture-of-experts model: compute counts the parameters a token runs through
            shape["inactive_params"] = inactive
    return shape


def flops_per_token(model, config: RunConfig, n_params: int) -> float:
    """Training FLOPs per token of `model` (forward and backward), for TFLOP/s and MFU."""
    from dstrain.models.gpt import GPT, flops_per_token as gpt_flops_per_token
    from dstrain.models.hf import CausalLM, flops_per_token as hf_flops_per_token
    if isinstance(model, CausalLM):
        return hf_flops_per_token(model, n_params, config.data.seq_len)
    if isinstance(model, GPT):
        m = config.model
        return gpt_flops_per_token(n_params, m.n_layer, m.d_model, config.data.seq_len, m.vocab_size)
    return 6.0 * n_params  # a user model: the 6N rule of thumb


@contextlib.contextmanager
def _initializers_skipped():
    """torch.nn.init's in-place initializers as no-ops: a meta tensor has no values to fill, and
    filling one runs torch's reference kernels, whose first use imports torch._dynamo (4 s of
    `dstrain run`'s pre-launch check on a GPU machine, docs/benchmarks.md)."""
    from torch.nn import init
    names = [n for n in dir(init) if n.endswith("_") and not n.startswith("_") and callable(getattr(init, n))]
    saved = {n: getattr(init, n) for n in names}
    try:
        for n in names:
            setattr(init, n, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for n, fn in saved.items():
            setattr(init, n, fn)


def count_model(build_fn: Callable[[], Any]) -> tuple[int, int]:
    """(total parameters, largest single module's direct parameters) of `build_fn()`, built on the
    meta device so no storage is allocated. Shared (tied) parameters count once."""
    import torch

    with torch.device("meta"), _initializers_skipped():
        model = build_fn()
    return parameter_counts(model)


def trainable_parameters(model) -> int:
    """Parameters that reach the optimizer, full sizes also where ZeRO-3 partitioned them; tied ones once."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)


def parameter_counts(model) -> tuple[int, int]:
    """(total parameters, largest single module's direct parameters) of a built model, full sizes also
    where ZeRO-3 built it partitioned (ds_numel). Shared (tied) parameters count once."""
    def numel(p):
        return getattr(p, "ds_numel", p.numel())

    total = sum(numel(p) for p in model.parameters())  # parameters() yields a tied tensor once
    largest = max((sum(numel(p) for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return total, largest
