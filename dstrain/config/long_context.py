"""The memory switches for long sequences that need no model: train.tiled_mlp ("auto" decided here) and
train.activation_checkpointing_offload (its refusals). No torch import: resolution runs before any rank
starts. The model-dependent part (an "hf:" model without decoder-layer MLPs) is decided on the ranks
(dstrain.rank.runtime.apply_tiled_mlp). See docs/long-context.md."""

from __future__ import annotations

from typing import Any

from dstrain.config.layers import Merged
from dstrain.config.schema import TILED_MLP_MIN_SEQ_TOKENS, RunConfig
from dstrain.errors import Problem


def sequence_tokens_per_rank(config: RunConfig) -> int:
    """Tokens of one sequence on one rank: seq_len / sequence_parallel."""
    return config.data.seq_len // config.train.sequence_parallel


def _frozen_weights(config: RunConfig) -> bool:
    return config.model.lora is not None or bool(config.train.frozen) or bool(config.train.trainable)


def resolve_tiled_mlp(config: RunConfig, ds: dict[str, Any], merged: Merged, accelerator: str,
                      notes: dict[str, str], problems: list[Problem]) -> None:
    """train.tiled_mlp: true where it cannot apply is an error; "auto" becomes true or false here."""
    chosen, where = config.train.tiled_mlp, merged.where("train.tiled_mlp")
    hf = config.model.name.startswith("hf:")
    zero = ds.get("zero_optimization")
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0  # a malformed section is reported elsewhere
    # At ZeRO-3 with frozen weights the layers are not leaf modules (preflight._fetch_blocks_whole), so every
    # shard would gather the MLP's weights again, and ranks whose shard counts differ would hang.
    zero3_frozen = stage == 3 and _frozen_weights(config)
    if chosen is True:
        if not hf:
            problems.append(Problem(f"tiled MLP replaces the MLP forward of Hugging Face decoder layers; model "
                                    f"{config.model.name!r} is not an \"hf:\" model", where,
                                    "use an \"hf:\" model, or set train.tiled_mlp=false"))
        elif zero3_frozen:
            problems.append(Problem("tiled MLP at ZeRO-3 needs each decoder layer fetched whole (a leaf module), "
                                    "which dstrain does not do with frozen weights (model.lora, train.frozen, "
                                    "train.trainable)", where,
                                    "use a stage 0-2 preset (e.g. --preset stage2), or set train.tiled_mlp=false"))
        return
    if chosen is False:
        return
    tokens = sequence_tokens_per_rank(config)
    why = None
    if not hf:
        why = "not an \"hf:\" model"
    elif accelerator != "cuda":
        why = "CPU ranks"
    elif zero3_frozen:
        why = "ZeRO-3 with frozen weights: the decoder layers are not fetched whole"
    elif tokens < TILED_MLP_MIN_SEQ_TOKENS:
        why = (f"{tokens:,} tokens of a sequence per rank < {TILED_MLP_MIN_SEQ_TOKENS:,}: a smaller micro batch "
               "saves the memory without the recompute")
    config.train.tiled_mlp = why is None
    notes["train.tiled_mlp"] = (f"auto: off ({why})" if why else
                                f"auto: on ({tokens:,} tokens of a sequence per rank >= {TILED_MLP_MIN_SEQ_TOKENS:,})")


def check_checkpoint_offload(config: RunConfig, merged: Merged, accelerator: str, problems: list[Problem]) -> None:
    """train.activation_checkpointing_offload's refusals: it moves the checkpointed inputs of transformers'
    per-layer checkpointing, so it needs that checkpointing, an "hf:" model and a GPU to move them from."""
    if not config.train.activation_checkpointing_offload:
        return
    where = merged.where("train.activation_checkpointing_offload")
    if not config.model.name.startswith("hf:"):
        problems.append(Problem("checkpoint offload moves the checkpointed inputs of transformers' decoder layers; "
                                f"model {config.model.name!r} is not an \"hf:\" model", where,
                                "use an \"hf:\" model (for the built-in GPT: deepspeed.activation_checkpointing."
                                "cpu_checkpointing=true), or set train.activation_checkpointing_offload=false"))
    if config.train.activation_checkpointing is False:
        problems.append(Problem("checkpoint offload moves the inputs activation checkpointing keeps, but "
                                "train.activation_checkpointing is false", where,
                                "set train.activation_checkpointing=true, or train.activation_checkpointing_offload=false"))
    if accelerator != "cuda":
        problems.append(Problem("checkpoint offload copies GPU activations to pinned host memory; on CPU ranks they "
                                "already are in host memory (DeepSpeed's offload does nothing there)", where,
                                "run on GPUs (--accelerator cuda), or set train.activation_checkpointing_offload=false"))
