"""train.precision=fp8: the model's linear layers multiply in FP8 through torchao's float8 training.

torchao's `convert_to_float8_training` swaps an nn.Linear for its `Float8Linear`, a subclass whose forward
casts the input and the weight to FP8 with dynamic scales (per tensor, or per row with the "rowwise"
recipe), multiplies them with torch._scaled_mm, and does the same for the two backward matmuls. The
parameters are the nn.Linear's own objects, so everything else is bf16 training's: DeepSpeed's bf16 weights,
fp32 masters and optimizer states, ZeRO's partitions (a ZeRO-3 partitioned weight is gathered by DeepSpeed's
module hooks before Float8Linear's forward reads it, as for any nn.Linear), and checkpoints whose state
dict keys do not change, which load into the unconverted bf16 model.

Which layers convert (`fp8_layers`): the linear layers inside the decoder layers, except those of the first and
the last decoder layer, which stay bf16 together with the LM head and any linear outside the decoder layers
(as Megatron-Core's first_last_layers_bf16 and torchtitan's float8 examples keep a model's ends); a layer with a
dimension not divisible by 16 (what torch._scaled_mm needs) and a frozen one stay bf16 too.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import torch
from torch import nn

from dstrain.errors import Problem

# FP8 tensor cores: Ada (8.9) and Hopper (9.0) onwards; torch._scaled_mm refuses older GPUs.
FP8_MIN_CAPABILITY = (8, 9)
INSTALL = "pip install 'dstrain[fp8]'"


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated decoder layers, in order: an hf: model's (its _no_split_modules classes), the
    built-in GPT's blocks."""
    from dstrain.models import hf
    from dstrain.models.gpt import GPT
    if isinstance(model, GPT):
        return list(model.blocks)
    return hf.decoder_blocks(model)


def fp8_layers(model: nn.Module) -> tuple[set[str], dict[str, str]]:
    """The qualified names of the linear layers to convert, and each other linear layer with why it stays
    bf16. The dimensions are read from in_features/out_features: under ZeRO-3 a weight is a partition."""
    layers = decoder_layers(model)
    ends = {id(layers[0]), id(layers[-1])} if layers else set()
    inside: dict[int, bool] = {}  # id(linear) -> in an end layer
    for layer in layers:
        for module in layer.modules():
            inside[id(module)] = id(layer) in ends
    chosen, kept = set(), {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if id(module) not in inside:
            kept[name] = "outside the decoder layers (the LM head, an embedding projection)"
        elif inside[id(module)]:
            kept[name] = "in the first or the last decoder layer"
        elif module.in_features % 16 or module.out_features % 16:
            kept[name] = f"{module.in_features} x {module.out_features}: a dimension not divisible by 16"
        elif not module.weight.requires_grad:
            kept[name] = "frozen"
        else:
            chosen.add(name)
    return chosen, kept


def float8_config(recipe: str, emulate: bool = False, fast_accum: bool = True):
    """torchao's Float8LinearConfig for a recipe name; `emulate` multiplies in bf16 from FP8-rounded values
    (torchao's testing mode, which runs on CPU), for tests of everything around the matmul; `fast_accum`
    False turns the forward matmul's fast accumulation off (torchao's recipes turn it on there)."""
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.config import Float8GemmConfig
    config = Float8LinearConfig.from_recipe_name(recipe)
    if not fast_accum:
        config = dataclasses.replace(config, gemm_config_output=Float8GemmConfig(use_fast_accum=False))
    return dataclasses.replace(config, emulate=True) if emulate else config


def convert_to_fp8(model: nn.Module, recipe: str, emulate: bool = False, fast_accum: bool = True) -> str:
    """Swap the chosen linear layers (fp8_layers) for torchao's Float8Linear, in place; a line for rank 0."""
    check_device(emulate)
    from torchao.float8 import convert_to_float8_training
    chosen, kept = fp8_layers(model)
    if not chosen:
        raise RuntimeError("train.precision=fp8: no linear layer to convert (a model of two decoder layers or fewer "
                           "keeps them all in bf16); set train.precision=bf16")
    convert_to_float8_training(model, module_filter_fn=lambda _module, name: name in chosen,
                               config=float8_config(recipe, emulate, fast_accum))
    reasons = sorted(set(kept.values()))
    accumulation = "" if fast_accum else ", full-precision accumulation"
    return (f"fp8: {len(chosen)} of {len(chosen) + len(kept)} linear layers multiply in FP8 (torchao {recipe}{accumulation}); "
            f"kept in bf16: " + "; ".join(f"{sum(r == v for v in kept.values())} {r}" for r in reasons))


def check_device(emulate: bool = False) -> None:
    """On a rank: the GPU must have FP8 matmuls (the `dstrain` command checked its own host's GPUs; a rank
    of another node checks its own)."""
    if emulate:
        return
    if not torch.cuda.is_available():
        raise RuntimeError("train.precision=fp8 runs on CUDA GPUs only")
    capability = torch.cuda.get_device_capability()
    if capability < FP8_MIN_CAPABILITY:
        raise RuntimeError(f"train.precision=fp8: {torch.cuda.get_device_name()} (compute capability "
                           f"{capability[0]}.{capability[1]}) has no FP8 matmuls (8.9 or more); set "
                           "train.precision=bf16")


def runtime_problems(where: str) -> list[Problem]:
    """Before any rank starts, in the `dstrain` process: torchao installed with its float8 training, and this
    host's GPUs able to multiply in FP8 (compute capability 8.9 or more)."""
    problems = []
    if importlib.util.find_spec("torchao") is None:
        problems.append(Problem("FP8 training runs through torchao's float8 training, and torchao is not installed",
                                where, f"{INSTALL} (or set train.precision=bf16)"))
    elif importlib.util.find_spec("torchao.float8") is None:
        import torchao
        problems.append(Problem(f"the installed torchao {getattr(torchao, '__version__', '?')} has no float8 training "
                                "(torchao.float8)", where, f"{INSTALL} (torchao 0.16 or later)"))
    if torch.cuda.is_available():
        slow = sorted({f"{torch.cuda.get_device_name(i)} (compute capability {'.'.join(map(str, cap))})"
                       for i in range(torch.cuda.device_count())
                       if (cap := torch.cuda.get_device_capability(i)) < FP8_MIN_CAPABILITY})
        if slow:
            problems.append(Problem(f"FP8 matmuls need compute capability 8.9 or more (Ada, Hopper, Blackwell); this "
                                    f"machine has {', '.join(slow)}", where, "set train.precision=bf16"))
    return problems
