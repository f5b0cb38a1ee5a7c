"""Checks before anything is written or spawned, for the ones that need torch or DeepSpeed: DeepSpeed's
own config models, the model (built on the meta device: no memory), the data source, the NVMe
swap buffer, and op-build locks left by killed builds.

The pure config checks are in dstrain/config/; these run after them, still in the `dstrain` process,
so a typo costs seconds, not a GPU allocation.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from typing import TYPE_CHECKING

from rich.console import Console

from dstrain.config.resolve import ResolvedConfig
from dstrain.console_text import outside
from dstrain.errors import Problem, UserError

if TYPE_CHECKING:
    from dstrain.models import ModelFacts


def _fit_nvme_swap_buffer(resolved: ResolvedConfig, largest: int) -> None:
    """NVMe parameter offload swaps through buffers of offload_param.buffer_size elements, and DeepSpeed
    fails mid-start when one parameter (a large embedding, say) does not fit one: grow it to fit."""
    offload = (resolved.ds_config.get("zero_optimization") or {}).get("offload_param") or {}
    if offload.get("device") == "nvme" and int(offload.get("buffer_size", 100_000_000)) < largest:
        offload["buffer_size"] = largest
        resolved.warnings.append(f"deepspeed.zero_optimization.offload_param.buffer_size raised to {largest:,}: "
                                 "the model's largest parameter must fit one NVMe swap buffer")


def _named(resolved: ResolvedConfig, *paths: str) -> str:
    """Key paths with the layer that set them, for a message: 'train.precision (from --config run.yaml)'."""
    def one(path: str) -> str:
        source = resolved.sources.get(path, "default")
        return path if source == "default" else f"{path} (from {source})"
    # a key that only follows another named here ("follows train.precision") adds nothing
    kept = [p for p in paths if not any(f"follows {other}" in resolved.sources.get(p, "") for other in paths)]
    return " / ".join(one(p) for p in kept)


def check_runnable(resolved: ResolvedConfig) -> None:
    """What the chosen accelerator or the installed DeepSpeed cannot run, each refused with its key path
    and fix, before any rank starts (DeepSpeed would stop every rank at start, or minutes later). DeepSpeed
    is asked, not a list kept here: its CPU accelerator's fp16 support and op builders, its optimizers."""
    problems = []
    ds = resolved.ds_config
    zero = ds.get("zero_optimization") if isinstance(ds.get("zero_optimization"), dict) else {}
    if resolved.accelerator == "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
        from deepspeed.ops.op_builder.cpu.no_impl import NotImplementedBuilder
        cpu = CPU_Accelerator()
        if resolved.precision == "fp16" and not cpu.is_fp16_supported():
            problems.append(Problem("fp16 does not run on CPU ranks: DeepSpeed's CPU accelerator refuses it at start "
                                    "('Type fp16 is not supported on your device')",
                                    _named(resolved, "train.precision", "deepspeed.fp16.enabled"),
                                    "set train.precision=bf16 (or fp32), or run on GPUs (--accelerator cuda)"))
        quantized = [key for key in ("zero_quantized_weights", "zero_quantized_nontrainable_weights",
                                     "zero_quantized_gradients") if zero.get(key) is True]
        if quantized and isinstance(cpu.create_op_builder("QuantizerBuilder"), NotImplementedBuilder):
            problems.append(Problem("ZeRO++ quantization needs DeepSpeed's quantizer op, which exists only for CUDA",
                                    _named(resolved, *(f"deepspeed.zero_optimization.{key}" for key in quantized)),
                                    "remove " + ", ".join(quantized) + " (or set false) for CPU ranks, "
                                    "or run on GPUs (--accelerator cuda)"))
        if resolved.config.model.kwargs.get("attn_implementation") == "flex_attention":
            why = _flex_attention_backward_on_cpu()
            if why:
                problems.append(Problem(f"flex_attention cannot train on CPU ranks: torch says \"{why}\"",
                                        _named(resolved, "model.kwargs.attn_implementation"),
                                        "use sdpa (or eager) on CPU ranks, or run on GPUs (--accelerator cuda)"))
    if resolved.precision == "fp8" and resolved.accelerator == "cuda":  # CPU ranks: refused in resolution
        from dstrain.models.fp8 import runtime_problems
        problems += runtime_problems(_named(resolved, "train.precision"))
    problems += _optimizer_problems(resolved)
    problems += _checkpoint_offload_problems(resolved)
    if resolved.config.model.lora is not None:
        from dstrain.models.hf import check_quantize
        problems += check_quantize(resolved.config, ds, resolved.accelerator)
    if problems:
        raise UserError(problems)


def _flex_attention_backward_on_cpu() -> str | None:
    """Why the installed torch's FlexAttention cannot run a backward on CPU (its first line), or None where it
    can: asked of torch with a 16-token call, which it refuses before computing anything."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention
    query = torch.zeros(1, 1, 16, 16, requires_grad=True)
    try:
        flex_attention(query, query, query).sum().backward()
    except NotImplementedError as err:
        return str(err).split(". ")[0]
    return None


def _checkpoint_offload_problems(resolved: ResolvedConfig) -> list:
    """train.activation_checkpointing_offload runs DeepSpeed's checkpoint offload manager, which DeepSpeed
    0.18 does not have (deepspeed.runtime.activation_checkpointing.offload_activations): every rank would
    stop at its first step."""
    import importlib.util
    if not resolved.config.train.activation_checkpointing_offload:
        return []
    if importlib.util.find_spec("deepspeed.runtime.activation_checkpointing.offload_activations") is not None:
        return []
    import deepspeed
    return [Problem(f"the installed DeepSpeed {deepspeed.__version__} has no activation checkpoint offload "
                    "(deepspeed.runtime.activation_checkpointing.offload_activations)",
                    _named(resolved, "train.activation_checkpointing_offload"),
                    "pip install 'deepspeed==0.19.8' (the verified version), or set "
                    "train.activation_checkpointing_offload=false")]


def _optimizer_problems(resolved: ResolvedConfig) -> list:
    """DeepSpeed builds optimizer.type by name: one of its own (runtime/config.py's DEEPSPEED_OPTIMIZERS,
    case-insensitive) or a torch.optim class; anything else stops every rank at start. The 1-bit
    optimizers (OneBitAdam, OneBitLamb, ZeroOneAdam) are gone from DeepSpeed 0.19."""
    import torch
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS
    optimizer = resolved.ds_config.get("optimizer")
    name = optimizer.get("type") if isinstance(optimizer, dict) else None
    if not isinstance(name, str) or name.lower() in DEEPSPEED_OPTIMIZERS or getattr(torch.optim, name, None):
        return []
    from_train = "train.optimizer" in resolved.sources.get("deepspeed.optimizer.type", "")
    import deepspeed
    known = sorted(DEEPSPEED_OPTIMIZERS)
    where = _named(resolved, "train.optimizer") if from_train else _named(resolved, "deepspeed.optimizer.type")
    fix = ("set train.optimizer=adamw (or adam, lamb)" if from_train else
           f"use one of DeepSpeed's ({', '.join(known)}) or a torch.optim class name, e.g. AdamW")
    return [Problem(f"the installed DeepSpeed {deepspeed.__version__} has no optimizer {name!r} (DeepSpeed would stop "
                    f"every rank at start: '{name} is not a supported DeepSpeed Optimizer')", where, fix)]


def check_runtime(resolved: ResolvedConfig) -> tuple[int, int]:
    """Checks that import DeepSpeed/torch: what the accelerator and the installed DeepSpeed cannot run,
    the model (built on the meta device: no memory) and the data source. Returns the parameter count and
    how many of them train. (DeepSpeed's config models already ran in resolution: `dstrain config` gives
    the same verdict.)"""
    check_runnable(resolved)
    from dstrain.models import check_model
    try:
        facts = check_model(resolved.config)
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001 - a user model that cannot be built is bad input
        raise UserError.single(f"building the model failed: {type(err).__name__}: {err}", "model",
                               "check model.name and model.kwargs")
    _decide_loss_chunking(resolved, facts.loss_chunking, facts.loss_note, facts.loss_why)
    _decide_tiled_mlp(resolved, facts.mlps)
    _check_data(resolved)
    check_trackers(resolved)
    _fit_nvme_swap_buffer(resolved, facts.largest)
    apply_block_defaults(resolved, facts)
    from dstrain.hardware import cuda_gpu_memory_bytes
    keep_large_gpt_blocks_whole(resolved, facts.params, facts.largest, cuda_gpu_memory_bytes)
    return facts.params, facts.trainable


def apply_block_defaults(resolved: ResolvedConfig, facts: ModelFacts) -> None:
    """An hf: model's ZeRO-3 defaults that need the model built: each decoder layer one fetch, and kept
    whole on GPUs. `dstrain estimate` applies them too, so that it estimates what runs."""
    _fetch_blocks_whole(resolved, facts.block_class, frozen=facts.trainable < facts.params)
    _settle_stage3_compile(resolved, whole=_keep_blocks_whole(resolved, facts))


def _settle_stage3_compile(resolved: ResolvedConfig, whole: bool) -> None:
    """train.compile "auto" left pending for an hf: model at ZeRO-3 (config/speed_defaults.py): its decoder
    layers compiled where they stay whole, eager where DeepSpeed shards them (measured no faster)."""
    from dstrain.config.speed_defaults import HF_STAGE3_COMPILE_PENDING, HF_STAGE3_SHARDED, HF_STAGE3_WHOLE
    if resolved.sources.get("train.compile") != f"auto: off ({HF_STAGE3_COMPILE_PENDING})":
        return
    train = resolved.config.train
    resolved.config = resolved.config.model_copy(update={"train": train.model_copy(update={"compile": whole})})
    resolved.sources["train.compile"] = f"auto: on ({HF_STAGE3_WHOLE})" if whole else f"auto: off ({HF_STAGE3_SHARDED})"


def _decide_loss_chunking(resolved: ResolvedConfig, chunked: bool, note: str | None, why: str | None) -> None:
    """train.loss_chunking as the model built on the meta device took it: true on an hf: model whose forward
    dstrain cannot split becomes false in the config the ranks get (it keeps its own loss, with a note)."""
    automatic = resolved.sources.get("train.loss_chunking", "").startswith("auto")
    if note and not automatic:  # asked for by the user: say why it does not apply
        resolved.warnings.append(note)
    train = resolved.config.train
    if train.loss_chunking != chunked:
        was = "auto" if automatic else train.loss_chunking
        resolved.config = resolved.config.model_copy(update={"train": train.model_copy(update={"loss_chunking": chunked})})
        resolved.sources["train.loss_chunking"] = f"{was}: {'on' if chunked else 'off'} for this model ({why})"


def _decide_tiled_mlp(resolved: ResolvedConfig, mlps: int) -> None:
    """train.tiled_mlp on a model whose decoder layers have no MLP dstrain can tile (dstrain.models.tiled_mlp:
    an `mlp` of a *MLP class; mixture-of-experts blocks are not): "auto" turns off with a note, true is an error."""
    train = resolved.config.train
    if train.tiled_mlp is not True or mlps or not resolved.config.model.name.startswith("hf:"):
        return
    source = resolved.sources.get("train.tiled_mlp", "")
    why = "no decoder layer of this model has an `mlp` module of an *MLP class (mixture-of-experts blocks are not tiled)"
    if not source.startswith("auto"):
        raise UserError.single(f"tiled MLP: {why}", _named(resolved, "train.tiled_mlp"),
                               "set train.tiled_mlp=false (or auto)")
    resolved.config = resolved.config.model_copy(update={"train": train.model_copy(update={"tiled_mlp": False})})
    resolved.sources["train.tiled_mlp"] = f"auto: off for this model ({why})"
    resolved.warnings.append(f"train.tiled_mlp: auto: off: {why}")


def _fetch_blocks_whole(resolved: ResolvedConfig, block_class: str | None, frozen: bool) -> None:
    """ZeRO-3 with an hf: model: each transformer block is one fetch (DeepSpeed's leaf modules), as
    dstrain/config/resolve.py does for the built-in GPT, unless the user chose the granularity.
    DeepSpeed's own default leaf classes (MoE blocks) are kept. Not where some weights are frozen
    (LoRA, train.frozen): DeepSpeed 0.19 releases a leaf block's partitioned weights before autograd
    has stored the trainable ones' gradients ("The size of tensor a (0) must match ...")."""
    zero = resolved.ds_config.get("zero_optimization")
    if (block_class is None or frozen or not isinstance(zero, dict) or zero.get("stage") != 3
            or "leaf_module" in zero or "stage3_module_granularity_threshold" in zero
            or (zero.get("offload_param") or {}).get("device") == "nvme"):
        return
    from deepspeed.runtime.zero.leaf_module_config import DEFAULT_LEAF_MODULE_CLASSES
    zero["leaf_module"] = {"classes": [*DEFAULT_LEAF_MODULE_CLASSES, block_class]}
    resolved.sources["deepspeed.zero_optimization.leaf_module"] = \
        f"dstrain default for hf: models at stage 3: a {block_class.rsplit('.', 1)[-1]} is one ZeRO-3 fetch"


def _keep_blocks_whole(resolved: ResolvedConfig, facts: ModelFacts) -> bool:
    """ZeRO-3 on GPUs without offload, an hf: model whose decoder layers are leaf modules (above): keep
    each layer's parameters whole on every rank (persistence threshold: the layer's largest weight) and
    torch's linear, as dstrain/config/speed_defaults.py does for the built-in GPT: DeepSpeed's per-layer
    fetch and release in Python then stop pacing the step, and dstrain's ZeRO-3 step removes the layers'
    hooks (speedups/zero3_unhook.py). Gradients and optimizer states stay sharded; every GPU holds the
    layers' 16-bit weights. On one GPU at any size (one rank's shard is the whole model anyway), on several
    up to SMALL_GPT_PARAMS parameters. Only where the preset's values stand (the user set none of the keys).
    True where it kept them whole."""
    from dstrain.config.speed_defaults import SMALL_GPT_PARAMS, weight_bytes
    zero = resolved.ds_config.get("zero_optimization")
    if (resolved.accelerator != "cuda" or not facts.block_largest or not _whole_blocks_open(resolved)
            or facts.block_class not in (zero.get("leaf_module") or {}).get("classes", [])):
        return False
    world = resolved.world_size
    if world > 1 and facts.params > SMALL_GPT_PARAMS:
        return False
    # never below the preset's: a small model's layers were whole already, and so stays its embedding
    _keep_whole(resolved, max(facts.block_largest, zero.get("stage3_param_persistence_threshold", 0)),
                "dstrain default for hf: models on one GPU: each decoder layer stays whole" if world == 1 else
                f"dstrain default for hf: models under {SMALL_GPT_PARAMS / 1e9:g}B parameters: each decoder layer stays "
                f"whole on every rank ({weight_bytes(resolved.config) * facts.block_params / 2**30:.1f} GiB of weights a "
                "GPU; set 100000 to shard them)", "decoder layers")
    return True


def _whole_blocks_open(resolved: ResolvedConfig) -> bool:
    """ZeRO-3 without offload, where the user set none of the keys that keep blocks whole (dstrain's
    defaults may then set them)."""
    from dstrain.config.speed_defaults import WHOLE_BLOCK_KEYS, ZERO, zero3_without_offload
    return (zero3_without_offload(resolved.ds_config.get("zero_optimization"))
            and all(resolved.sources.get(f"{ZERO}.{key}", "default").startswith(("preset ", "default"))
                    for key in WHOLE_BLOCK_KEYS))


def _keep_whole(resolved: ResolvedConfig, threshold: int, why: str, blocks: str) -> None:
    """Keep parameters of up to `threshold` elements whole on every rank, with torch's linear."""
    from dstrain.config.speed_defaults import ZERO
    resolved.ds_config["zero_optimization"].update(stage3_param_persistence_threshold=threshold,
                                                   memory_efficient_linear=False)
    resolved.sources[f"{ZERO}.stage3_param_persistence_threshold"] = why
    resolved.sources[f"{ZERO}.memory_efficient_linear"] = f"dstrain default with {blocks} kept whole"


# Past SMALL_GPT_PARAMS, a built-in GPT's blocks stay whole only where the memory estimate with them whole
# stays under this share of one GPU's memory: whole blocks are a speed choice, never worth running out of
# memory (the estimate ran 4-5 GiB above the measured peaks at 3.78B and 6.6B on four H200s).
LARGE_GPT_WHOLE_MAX_SHARE = 0.85


def keep_large_gpt_blocks_whole(resolved: ResolvedConfig, params: int, largest: int,
                                gpu_mem: Callable[[], int | None]) -> bool:
    """The built-in GPT past SMALL_GPT_PARAMS at ZeRO-3 on several GPUs, where speed_defaults left its
    blocks split: keep each block whole as below that size where the memory estimate with them whole fits
    LARGE_GPT_WHOLE_MAX_SHARE of one GPU (`largest`: the model's largest parameter; `gpu_mem`: the smallest
    GPU's bytes, asked only when the rest applies; None: left split). The launching host's GPUs stand for every node's. With activation
    checkpointing "auto", only where whole blocks leave auto's choice as it was (they would otherwise turn
    it on: recomputing costs more than they gain). Measured on four H200s: 3.78B 1.16x DDP whole against
    0.81x split (35.7 against 30.6 GiB a GPU; two GPUs: 1.08x DDP), 6.6B 1.18x its split rate (54.5 against
    44.4 GiB). True where it kept them whole."""
    from dstrain.config.speed_defaults import GPT_ZERO3_LEAF, SMALL_GPT_PARAMS, blocks_gib, deepcompile_on
    from dstrain.hardware import host_memory_bytes
    from dstrain.tools.estimate import memory as E
    config, ds = resolved.config, resolved.ds_config
    world = resolved.world_size
    if (config.model.name != "gpt" or resolved.accelerator != "cuda" or world < 2 or params <= SMALL_GPT_PARAMS
            or not _whole_blocks_open(resolved) or deepcompile_on(ds)
            or GPT_ZERO3_LEAF not in (ds["zero_optimization"].get("leaf_module") or {}).get("classes", [])):
        return False
    gpu_mem_bytes = gpu_mem()
    if not gpu_mem_bytes:
        return False
    threshold = 4 * config.model.d_model ** 2  # a block's largest weight (the MLP's)
    whole = {**ds, "zero_optimization": {**ds["zero_optimization"], "stage3_param_persistence_threshold": threshold,
                                         "memory_efficient_linear": False}}
    hw = E.Hardware(gpus_per_node=world, nodes=1, gpu_mem_bytes=gpu_mem_bytes, cpu_mem_bytes=host_memory_bytes()[0])
    checkpointing = config.train.activation_checkpointing
    if checkpointing == "auto":  # what each rank will decide (rank/runtime.checkpointing_wanted), split and whole
        split_on, _ = E.auto_checkpointing(E.placement_from_ds_config(ds), E.workload(config, ds, params, largest, False), hw)
        whole_on, _ = E.auto_checkpointing(E.placement_from_ds_config(whole), E.workload(config, whole, params, largest, False), hw)
        if whole_on != split_on:
            return False
        checkpointing = whole_on
    work = E.workload(config, whole, params, largest, checkpointing is True)
    peak = E.estimate_one("stage3", E.placement_from_ds_config(whole), work, hw).gpu_bytes_per_gpu
    if peak > LARGE_GPT_WHOLE_MAX_SHARE * gpu_mem_bytes:
        return False
    _keep_whole(resolved, threshold,
                f"dstrain default for a built-in GPT past {SMALL_GPT_PARAMS / 1e9:g}B parameters where it fits: each block "
                f"stays whole on every rank ({blocks_gib(config):.1f} GiB of weights a GPU; estimated peak "
                f"{peak / 2**30:.1f} of {gpu_mem_bytes / 2**30:.0f} GiB; set 100000 to shard them)", "blocks")
    return True


# train.log_to name -> (the module it needs, the pip extra that installs it); csv needs nothing.
TRACKER_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}


def check_trackers(resolved: ResolvedConfig) -> None:
    """Every tracker train.log_to names has its package installed (here: the ranks share this Python), and
    a user's "module:Class" imports and has the tracker methods."""
    import importlib.util

    from dstrain.entrypoints import is_entry_point, load_tracker_class
    from dstrain.errors import Problem
    where = "train.log_to" + (f" (from {resolved.sources['train.log_to']})" if "train.log_to" in resolved.sources else "")
    problems = []
    for name in resolved.config.train.log_to:
        if is_entry_point(name):  # a user's class: imported and checked here, before any rank starts
            try:
                load_tracker_class(name, where)
            except UserError as err:
                problems += err.problems
            continue
        module, extra = TRACKER_PACKAGES.get(name, (None, None))
        if module and importlib.util.find_spec(module) is None:
            problems.append(Problem(f"{name} is not installed", where,
                                    f"pip install 'dstrain[{extra}]' (or {module}), or remove {name} from train.log_to"))
    if problems:
        raise UserError(problems)


def _check_data(resolved: ResolvedConfig) -> None:
    """The data checks, and data.packing decided for this model ("auto" becomes true or false in the
    config the ranks get, so they do not decide again)."""
    from dstrain.data import check_source
    from dstrain.models.packing import decide_packing
    resolved.warnings += check_source(resolved.config)
    packed, note = decide_packing(resolved.config)
    if note:
        resolved.warnings.append(note)
    data = resolved.config.data
    if data.packing != packed:
        resolved.config = resolved.config.model_copy(update={"data": data.model_copy(update={"packing": packed})})
        resolved.sources["data.packing"] = f"{data.packing}, decided for this model and data"


def clear_stale_build_locks(console: Console, dry_run: bool) -> None:
    """An op build killed mid-way leaves torch's lock file behind, and every later build of that op
    then waits for it forever, silently, inside the ranks. Such locks go before the ranks start."""
    from dstrain.launcher.env_fixes import stale_extension_locks
    for lock in stale_extension_locks():
        if dry_run:
            console.print(f"[yellow]note:[/] stale op build lock {outside(lock)} (left by a killed build); "
                          "a run removes it")
            continue
        try:
            lock.unlink(missing_ok=True)
        except OSError as err:
            raise UserError.single(f"stale op build lock {lock} cannot be removed ({err}): the ranks would wait "
                                   "on it forever", "TORCH_EXTENSIONS_DIR", f"rm {shlex.quote(str(lock))}")
        console.print(f"[yellow]note:[/] removed stale op build lock {outside(lock)} (left by a killed build)")
