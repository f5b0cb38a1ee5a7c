"""train.precision=fp8: what the config alone can refuse, before any rank starts (no torch import here).

FP8 training is bf16 training whose linear layers multiply in FP8 (torchao's float8 training,
dstrain/models/fp8.py): the weights, the fp32 master copy, the optimizer states and the checkpoints are
bf16 training's. So DeepSpeed gets its bf16 section, and every decision dstrain takes for bf16 weights
(`weight_precision`) is taken for fp8 too. What the installed torchao and the GPUs can do is checked in the
`dstrain` process after this (launcher/preflight.py through dstrain.models.fp8.runtime_problems).
"""

from __future__ import annotations

from typing import Any

from dstrain.config.layers import Merged
from dstrain.config.schema import RunConfig
from dstrain.errors import Problem

FIX_PRECISION = "set train.precision=bf16"


def weight_precision(precision: str) -> str:
    """The precision the weights, gradients and optimizer live in: fp8 trains bf16 weights."""
    return "bf16" if precision == "fp8" else precision


def check_fp8(config: RunConfig, ds: dict[str, Any], merged: Merged, accelerator: str,
              problems: list[Problem]) -> None:
    """Combinations FP8 training does not run, each with its reason and fix."""
    if config.train.precision != "fp8":
        return
    where = merged.where("train.precision")
    if accelerator != "cuda":
        problems.append(Problem(f"FP8 matmuls need GPUs of compute capability 8.9 or more (torch._scaled_mm); "
                                f"these ranks are {accelerator} ranks", where,
                                f"{FIX_PRECISION} (or fp32) for {accelerator} ranks, or run on such GPUs "
                                "(--accelerator cuda)"))
    name = config.model.name
    if name != "gpt" and not name.startswith("hf:"):
        problems.append(Problem(f"model {name!r} is your own model: dstrain picks the layers to convert only in the "
                                "built-in GPT and \"hf:\" models (their decoder layers)", where,
                                f"{FIX_PRECISION}, and call torchao.float8.convert_to_float8_training in your "
                                "model's builder"))
    if config.model.lora is not None:
        problems.append(Problem("FP8 with LoRA is not supported: the frozen base's weights would still be cast and "
                                "their unused weight gradients formed in FP8 by torchao's float8 linear, so only "
                                "the small adapters would gain", f"{where} / {merged.where('model.lora')}",
                                f"{FIX_PRECISION} for LoRA, or drop model.lora to fine-tune fully in FP8"))
    if config.train.mixed_precision == "autocast":
        problems.append(Problem("FP8 keeps bf16 training's weights through DeepSpeed's bf16 section; "
                                "train.mixed_precision=autocast (fp32 weights) was not tried with it",
                                f"{where} / {merged.where('train.mixed_precision')}",
                                "set train.mixed_precision=deepspeed, or train.precision=bf16"))
    section = ds.get("compile")
    if isinstance(section, dict) and section.get("deepcompile") is True:
        problems.append(Problem("DeepCompile was not tried with torchao's float8 linear layers",
                                f"{where} / {merged.where('deepspeed.compile.deepcompile')}",
                                f"remove deepspeed.compile.deepcompile (train.compile compiles the FP8 casts), or "
                                f"{FIX_PRECISION}"))
