"""dstrain's measured speed defaults for the DeepSpeed JSON, and the compile decisions that go with them.

Each default is rendered only where it was measured faster (docs/benchmarks.md names the finding) and
only where the user set none of its keys: a key set in a config file, by --set or by
PL_DEEPSPEED_CONFIG_PATH always wins. `dstrain config --explain` shows each one with its reason.
No torch import here: resolution runs before any rank starts.
"""

from __future__ import annotations

from typing import Any

from dstrain.config.fp8 import weight_precision
from dstrain.config.layers import PRESET_RANK, Merged
from dstrain.config.schema import LOSS_CHUNKING_MIN_SEQ_LEN, RunConfig
from dstrain.errors import Problem

# The built-in GPT's transformer block (dstrain.models.gpt.Block), named here without importing torch.
GPT_ZERO3_LEAF = "dstrain.models.gpt.Block"

# The built-in GPT's size up to which ZeRO-3 keeps every block whole on several ranks: its 16-bit
# weights then cost at most 6 GB a GPU more than their shard. Measured faster on two GPUs at 406M,
# 1.3B and 2.65B (docs/benchmarks.md, findings 30 and 44). Past 3B they stay whole only where the memory
# estimate says they fit the job's GPUs, decided at launch (launcher/preflight.keep_large_gpt_blocks_whole).
SMALL_GPT_PARAMS = 3_000_000_000

ZERO = "deepspeed.zero_optimization"
# The keys that keep ZeRO-3 blocks whole, under both of DeepSpeed's names (it refuses a config that gives
# one field twice); where the user set any of them, dstrain leaves them all alone.
WHOLE_BLOCK_KEYS = ("stage3_param_persistence_threshold", "param_persistence_threshold", "memory_efficient_linear",
                    "stage3_model_persistence_threshold", "model_persistence_threshold")


def render_speed_defaults(ds: dict[str, Any], config: RunConfig, merged: Merged, accelerator: str, world: int,
                          notes: dict[str, str]) -> None:
    """No device-syncing timer; for the built-in GPT under ZeRO-3 (unless the user turned DeepCompile on),
    a block fetched as one unit and a small GPT's blocks kept whole, and DeepCompile written out as off."""
    if "timers" not in ds:
        # DeepSpeed's throughput timer synchronizes the device twice a step; dstrain times steps itself.
        ds["timers"] = {"throughput": {"enabled": False}}
        notes["deepspeed.timers"] = "dstrain default: DeepSpeed's throughput timer off (dstrain measures throughput)"

    zero = ds.get("zero_optimization")
    _render_deepcompile(ds, config, merged, accelerator, world, notes)
    if deepcompile_on(ds):
        return  # DeepCompile gathers and releases in the compiled graph: no module hooks to tune
    if (config.model.name == "gpt" and isinstance(zero, dict) and zero.get("stage") == 3
            and "leaf_module" not in zero and "stage3_module_granularity_threshold" not in zero
            and (zero.get("offload_param") or {}).get("device") != "nvme"):
        # ZeRO-3 hooks every module and gathers its parameters one module at a time; for the
        # built-in GPT that made the step host-bound. Fetching each transformer block as one unit
        # doubled stage 3's throughput on one H100 (docs/benchmarks.md, finding 14). Not with
        # parameters on NVMe (unmeasured): a block at once needs more of its few swap buffers.
        zero["leaf_module"] = {"classes": [GPT_ZERO3_LEAF]}
        notes[f"{ZERO}.leaf_module"] = "dstrain default for the built-in GPT: a block is one ZeRO-3 fetch"
    _render_small_gpt_persistence(zero, config, merged, accelerator, world, notes)


def deepcompile_on(ds: dict[str, Any]) -> bool:
    section = ds.get("compile")
    return isinstance(section, dict) and section.get("deepcompile") is True


def zero3_without_offload(zero: Any) -> bool:
    return (isinstance(zero, dict) and zero.get("stage") == 3
            and all((zero.get(part) or {}).get("device", "none") == "none"
                    for part in ("offload_param", "offload_optimizer")))


def _render_deepcompile(ds: dict[str, Any], config: RunConfig, merged: Merged, accelerator: str, world: int,
                        notes: dict[str, str]) -> None:
    """DeepSpeed's DeepCompile for the built-in GPT's ZeRO-3 on one GPU: written out as off, with the
    reason, so that `dstrain config --explain` says so. DeepCompile compiles the gathers and releases into
    the graph, so none of ZeRO-3's module hooks run; it took dstrain's stage3 from 0.49-0.50 to 0.63-0.74
    of torch on the 406M GPT and 0.75 to 0.86 on the 1.3B (finding 32), and dstrain turned it on in runs
    of 5,000+ passes, long enough to repay its compile (~100-140 s before the first step, every run).
    dstrain's ZeRO-3 step and its blocks without hooks (speedups/zero3_step.py, zero3_unhook.py; findings 36
    and 37) took the eager preset past it: 0.54 / 0.63 of torch against DeepCompile's 0.56 on one host at
    406M, 0.96-0.97 against 0.86-0.87 at 913M and 1.3B, with no compile. Set it true to have it (bf16
    weights on CUDA, no offload, no activation checkpointing; several GPUs were not measured)."""
    if not (config.model.name == "gpt" and accelerator == "cuda" and world == 1 and config.train.precision == "bf16"
            and config.train.mixed_precision != "autocast" and config.train.compile is not False
            and not config.train.activation_checkpointing and zero3_without_offload(ds.get("zero_optimization"))):
        return
    if merged.source_of("deepspeed.compile.deepcompile").rank > PRESET_RANK:
        return  # the user's choice stands
    ds["compile"] = {**(ds.get("compile") if isinstance(ds.get("compile"), dict) else {}), "deepcompile": False}
    notes["deepspeed.compile.deepcompile"] = (
        "dstrain default: off: eager stage 3 with dstrain's step and whole blocks without hooks ran as fast on "
        "one GPU, without DeepCompile's ~2-minute compile (set true to have it)")


def _render_small_gpt_persistence(zero: Any, config: RunConfig, merged: Merged, accelerator: str, world: int,
                                  notes: dict[str, str]) -> None:
    """ZeRO-3 is host-bound on a small GPT: DeepSpeed's per-module fetch, release and re-fetch in
    Python outlast the blocks' compute (the device was 55% busy on the 406M GPT, two H200s). Keeping
    the blocks' parameters whole on every rank (persistent: never released, never gathered again) and
    letting torch's linear keep its weight for the backward (DeepSpeed's memory-efficient linear exists
    to not hold a gathered weight, which a persistent one is anyway) took dstrain's stage3 on the 406M GPT
    from 0.48 to 0.61 of torch on one H100 (medians of three pairs) and the hand loop 1.12x on two H200s
    (docs/benchmarks.md, finding 30). Gradients and optimizer states stay sharded; every GPU holds the
    blocks' 16-bit weights whole. On two H200s whole blocks took stage3 from 0.82-1.03 to 1.09-1.11 of DDP
    at 1.3B and from 0.96-1.01 to 1.09 at 2.65B, for 0.6 and 2.9 GiB more peak memory (finding 44).
    Only where the user set none of the keys, on GPUs, without offload (not measured there), up to 3B
    parameters on several GPUs (past that: launcher/preflight.keep_large_gpt_blocks_whole), or at any size
    on one GPU, where one rank's shard is the whole model anyway (1.3B: 1.07-1.09x, the same peak memory)."""
    if not (config.model.name == "gpt" and accelerator == "cuda" and zero3_without_offload(zero)):
        return
    if any(merged.source_of(f"{ZERO}.{key}").rank > PRESET_RANK for key in WHOLE_BLOCK_KEYS):
        return  # the user's choice stands
    m = config.model
    params = m.vocab_size * m.d_model + config.data.seq_len * m.d_model + m.n_layer * 12 * m.d_model ** 2
    if params > SMALL_GPT_PARAMS and world > 1:
        return
    zero["stage3_param_persistence_threshold"] = 4 * m.d_model ** 2  # a block's largest weight (the MLP's)
    zero["memory_efficient_linear"] = False
    notes[f"{ZERO}.stage3_param_persistence_threshold"] = (
        "dstrain default on one GPU: each block stays whole" if world == 1 else
        f"dstrain default for a built-in GPT under {SMALL_GPT_PARAMS / 1e9:g}B parameters: each block stays whole "
        f"on every rank ({blocks_gib(config):.1f} GiB of weights a GPU; set 100000 to shard them, as DeepSpeed would)")
    notes[f"{ZERO}.memory_efficient_linear"] = "dstrain default with blocks kept whole"


def weight_bytes(config: RunConfig) -> int:
    """Bytes a weight takes on the GPU: fp32 under autocast or fp32 training, else 16-bit."""
    return 4 if weight_precision(config.train.precision) == "fp32" or config.train.mixed_precision == "autocast" else 2


def blocks_gib(config: RunConfig) -> float:
    """The built-in GPT's blocks' weights in GiB."""
    return weight_bytes(config) * config.model.n_layer * 12 * config.model.d_model ** 2 / 2**30


# train.compile "auto" for an hf: model at ZeRO-3 until the model is checked: compiled where its decoder
# layers stay whole (1.18x / 1.06x DDP on two H200s), eager where DeepSpeed shards them (0.95x, one H100).
HF_STAGE3_COMPILE_PENDING = "ZeRO stage 3: on only where each decoder layer stays whole, decided when the model is checked"
HF_STAGE3_SHARDED = ("ZeRO stage 3 with the decoder layers sharded: measured no faster compiled (0.95x eager, "
                     "Qwen2.5-1.5B shape, one H100)")
HF_STAGE3_WHOLE = ("an hf: model at ZeRO stage 3 with each decoder layer kept whole: each compiled on its own "
                   "(measured 1.18x / 1.06x DDP on two H200s, Llama-3.2-1B / Qwen2.5-1.5B shapes)")


def resolve_compile(config: RunConfig, ds: dict[str, Any], accelerator: str, notes: dict[str, str]) -> None:
    """train.compile "auto": on where compiling was measured faster (docs/benchmarks.md), wherever
    DeepCompile is on, since engine.compile() is what starts it, and for an hf: model's decoder layers
    compiled one by one at ZeRO 0-2 (1.29x eager at stage 2 on one H100) and at ZeRO-3 where the layers
    stay whole (decided with the model: launcher/preflight.py; sharded layers measured 0.95x, so eager there:
    docs/performance.md)."""
    if config.train.compile != "auto":
        return
    if deepcompile_on(ds):
        config.train.compile = True
        notes["train.compile"] = "auto: on (DeepCompile starts with engine.compile())"
        return
    zero = ds.get("zero_optimization") if isinstance(ds.get("zero_optimization"), dict) else {}
    offloaded = [part for part in ("offload_optimizer", "offload_param")
                 if isinstance(zero.get(part), dict) and zero[part].get("device", "none") != "none"]
    hf = config.model.name.startswith("hf:")
    stage = zero.get("stage", 0)
    lora = config.model.lora
    # torchao's float8 casts (scale, cast, transpose around each matmul) are fused only when compiled (torchao's
    # float8 README asks for torch.compile); eager they eat FP8's gain, so FP8 compiles wherever the model can be.
    fp8 = config.train.precision == "fp8"
    if accelerator != "cuda":
        why_off = f"not on {accelerator}"
    elif config.train.objective != "lm":
        why_off = f"train.objective {config.train.objective} is not supported compiled (it runs the model twice)"
    elif config.model.name != "gpt" and not hf:
        why_off = "your own model: set true to compile it"
    elif weight_precision(config.train.precision) != "bf16":
        why_off = f"{config.train.precision} was not measured"
    elif hf and lora is not None and lora.quantize is not None:
        why_off = f"a {lora.quantize}-quantized base was not tried compiled"
    elif hf and lora is not None and stage == 3:
        why_off = ("LoRA at ZeRO stage 3: the frozen base's decoder layers are not ZeRO-3 leaf modules, so "
                   "DeepSpeed's per-layer hooks would fall inside each compiled block")
    elif stage == 3 and not hf and not fp8:
        why_off = "ZeRO stage 3 measured no faster compiled without DeepCompile"
    elif offloaded:
        why_off = f"{offloaded[0]} was not measured"
    elif config.train.activation_checkpointing and not (hf and stage < 3):
        # measured with an hf: model at ZeRO-2 only (one H200, 5.50B, 2026-11-29: compiled 1.15x eager in
        # bf16, 2.36x in fp8; benchmarks/results/2026-11-29-h200-fp8-24l-ac/)
        why_off = "activation checkpointing was measured compiled only for hf: models at ZeRO 0-2"
    elif stage == 3 and hf:
        # Decided once the model is checked (launcher/preflight.py: _keep_blocks_whole): on where each decoder
        # layer stays whole, off where DeepSpeed shards it.
        why_off = HF_STAGE3_COMPILE_PENDING
    else:
        why_off = None
    config.train.compile = why_off is None
    if why_off is not None:
        notes["train.compile"] = f"auto: off ({why_off})"
    elif hf:  # regional: rank/runtime.py compile_hf_blocks; DeepSpeed's ZeRO-3 hooks stay outside each block
        notes["train.compile"] = (f"auto: on (an hf: model, {config.train.precision}, CUDA, ZeRO {stage}: each decoder layer compiled "
                                  "on its own, the rest eager)")
    elif stage == 3:  # the built-in GPT in FP8: each block (a ZeRO-3 leaf module) compiled on its own
        notes["train.compile"] = ("auto: on (the built-in GPT in fp8 at ZeRO stage 3: each block compiled on its own, "
                                  "so that torchao's float8 casts are fused)")
    else:
        notes["train.compile"] = f"auto: on (the built-in GPT, {config.train.precision}, CUDA, ZeRO 0-2)"


def check_deepcompile(config: RunConfig, ds: dict[str, Any], merged: Merged, accelerator: str,
                      problems: list[Problem]) -> None:
    """DeepCompile settings that cannot run: refused before any rank starts, not at the first step."""
    if not deepcompile_on(ds):
        return
    where = merged.where("deepspeed.compile.deepcompile")
    if accelerator != "cuda":
        problems.append(Problem(f"DeepCompile needs CUDA: DeepSpeed has no {accelerator} implementation of its ops",
                                where, "remove deepspeed.compile.deepcompile, or run on GPUs"))
    if config.train.compile is False:
        problems.append(Problem("DeepCompile starts with engine.compile(), which train.compile=false turns off",
                                f"{where} / {merged.where('train.compile')}",
                                "set train.compile=true (or auto), or remove deepspeed.compile.deepcompile"))
    zero = ds.get("zero_optimization") if isinstance(ds.get("zero_optimization"), dict) else {}
    if zero.get("stage") == 3 and ("leaf_module" in zero or zero.get("stage3_module_granularity_threshold")):
        key = "leaf_module" if "leaf_module" in zero else "stage3_module_granularity_threshold"
        problems.append(Problem(
            "DeepCompile cannot trace ZeRO-3 leaf modules: their backward hook breaks the compiled graph, and "
            "the untraced forward then meets sharded weights ('weight' must be 2-D at the first step)",
            f"{where} / {merged.where(f'{ZERO}.{key}')}",
            f"remove deepspeed.zero_optimization.{key} (DeepCompile gathers each weight in the graph), "
            "or deepspeed.compile.deepcompile"))


def compile_warnings(config: RunConfig, ds: dict[str, Any], merged: Merged, warnings: list[str]) -> None:
    """Compilation settings that were measured to slow training down (docs/benchmarks.md)."""
    zero = ds.get("zero_optimization")
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    hf = config.model.name.startswith("hf:")
    if config.train.compile and stage == 3 and hf and config.model.lora is not None and not deepcompile_on(ds):
        warnings.append(f"{merged.where('train.compile')}: with LoRA at ZeRO stage 3 the model stays eager: its "
                        "decoder layers are not ZeRO-3 leaf modules (the base is frozen), and DeepSpeed's "
                        "per-layer hooks would fall inside each compiled block; consider train.compile=false")
    elif config.train.compile and stage == 3 and not hf and not deepcompile_on(ds) and config.train.precision != "fp8":
        warnings.append(f"{merged.where('train.compile')}: with ZeRO stage 3 compiling without DeepCompile "
                        "measured no faster than eager: the built-in GPT's blocks compiled one by one (ZeRO-3 "
                        "leaf modules, DeepSpeed's hooks outside the graph) 0.91-0.94x on a 406M GPT and 1.00x "
                        "on a 1.3B, a whole model with the gather hooks inside its graph 0.52x; consider "
                        "train.compile=false, or deepspeed.compile.deepcompile=true")


def resolve_loss_chunking(config: RunConfig, merged: Merged, notes: dict[str, str], problems: list[Problem]) -> None:
    """train.loss_chunking: "auto" is on for long sequences (LOSS_CHUNKING_MIN_SEQ_LEN), off for shorter
    ones (measured slower where the whole logits fit; true where memory binds). true on a model entry point
    is an error; true on an "hf:" model whose forward dstrain cannot split keeps its own loss, with a note
    (decided once the model is checked, before any rank starts)."""
    name, chosen = config.model.name, config.train.loss_chunking
    builtin_or_hf = name == "gpt" or name.startswith("hf:")
    if chosen is True and not builtin_or_hf:
        problems.append(Problem(f"model {name!r} is your own model, whose forward computes its loss: dstrain "
                                "cannot chunk it", merged.where("train.loss_chunking"),
                                "set train.loss_chunking=auto (or false), or call dstrain.models.chunked_loss."
                                "chunked_cross_entropy(hidden, head.weight, labels) in your model's forward"))
        return
    if config.train.precision == "fp16" and chosen is not False:
        # The chunked loss forms its gradients in the forward, before backward multiplies them by fp16's
        # loss scale: in fp16 the small ones would flush to zero where the reference keeps them.
        if chosen is True:
            problems.append(Problem("the chunked loss forms its gradients before fp16's loss scale applies, so small "
                                    "ones would underflow", merged.where("train.loss_chunking"),
                                    "train in bf16 (train.precision=bf16), or set train.loss_chunking=false"))
            return
        config.train.loss_chunking = False
        notes["train.loss_chunking"] = "auto: off (fp16: the chunked gradients would underflow before the loss scale)"
        return
    if chosen != "auto":
        return
    config.train.loss_chunking = False
    if not builtin_or_hf:
        notes["train.loss_chunking"] = "auto: off (your own model computes its own loss)"
    elif config.data.seq_len >= LOSS_CHUNKING_MIN_SEQ_LEN:
        # At long sequences the whole fp32 logits are gigabytes a rank (16 GiB at 131,072 tokens x 32,000), and
        # attention sets the step's time: TRL's fused LM head trained 262,144-token sequences at its plain
        # Accelerate peer's speed with half its memory (results/2026-11-26-h200x2-long-context-peers/).
        config.train.loss_chunking = True
        notes["train.loss_chunking"] = (
            f"auto: on ({config.data.seq_len:,} tokens a sequence >= {LOSS_CHUNKING_MIN_SEQ_LEN:,}: the whole logits "
            "would cost gigabytes a rank)")
    else:
        # Measured on one H100 (docs/performance.md): speed first where the run fits; the estimate and the
        # out-of-memory message point to true where memory binds.
        notes["train.loss_chunking"] = (
            f"auto: off under {LOSS_CHUNKING_MIN_SEQ_LEN:,} tokens a sequence (measured 0.93-0.97x the tokens/s for "
            "10-23% less peak GPU memory at a 151,936-token vocabulary, and no saving on a compiled 406M GPT; set "
            "true where memory binds: `dstrain estimate` shows the larger micro batch it fits)")
