"""Set-up shared by every rank, training or evaluating: process group, device, seeds, logging,
activation checkpointing. Runs inside the ranks only."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from datetime import timedelta
from typing import Any, Callable


def init_rank(collective_timeout_s: float | None = None, ds_config: dict | None = None):
    """Join the process group; returns (rank, world size, this rank's device). `collective_timeout_s`
    (dstrain.hangs.collective_timeout_s): how long any collective may wait before it fails. `ds_config`:
    the DeepSpeed config the rank will run (whether it needs DeepSpeed's shared-memory all-reduce)."""
    import deepspeed
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from deepspeed.accelerator import get_accelerator

    if not uses_shared_memory_all_reduce(ds_config or {}):
        skip_shared_memory_all_reduce_op()
    if collective_timeout_s:
        timeout = timedelta(seconds=collective_timeout_s)
        # Groups made later (the loop's gloo group, DeepSpeed's own) take torch's module default,
        # not the world group's timeout: set both.
        c10d.default_pg_timeout = timeout
        if getattr(c10d, "default_pg_nccl_timeout", None) is not None:
            c10d.default_pg_nccl_timeout = timeout
        deepspeed.init_distributed(timeout=timeout)
    else:
        deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    if get_accelerator().device_name() == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return rank, world, torch.device("cuda", local_rank)
    return rank, world, torch.device("cpu")


def uses_shared_memory_all_reduce(ds_config: dict) -> bool:
    """Whether a run calls DeepSpeed's `inference_all_reduce`, the one collective its CPU shared-memory op
    serves: only tensor-parallel layers do (AutoTP training, `tensor_parallel.autotp_size` above 1, or
    `tensor_parallel.tp.tp_size`). Training's all-reduces, reduce-scatters and all-gathers go through
    torch.distributed either way."""
    tensor_parallel = ds_config.get("tensor_parallel")
    if not isinstance(tensor_parallel, dict):
        return False
    inner = tensor_parallel.get("tp")
    sizes = [tensor_parallel.get("autotp_size"), tensor_parallel.get("tp_size"),
             inner.get("tp_size") if isinstance(inner, dict) else None]
    return any(isinstance(size, int) and size > 1 for size in sizes)


def skip_shared_memory_all_reduce_op() -> None:
    """Tell DeepSpeed not to build and load its CPU shared-memory all-reduce op (`deepspeed_shm_comm`) at
    init_distributed. On CPU ranks it is compiled at the first run of every Python environment (about
    100 s of CPU, minutes on a busy 2-core machine) and maps a 66 MB /dev/shm buffer per rank, for
    `inference_all_reduce` alone, which falls back to torch.distributed's all_reduce without it. DeepSpeed
    reads the op's availability from `deepspeed.ops.__compatible_ops__` (0.18 and 0.19 alike)."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    if builder is not None and isinstance(compatible, dict):
        compatible[builder.NAME] = False


def close_process_groups() -> None:
    """Destroy every process group at the end of a rank's run, as torch asks (NCCL warns otherwise).
    Called only after a run that returned: the collectives are over on every rank.

    Gloo first gets a barrier on each of its groups. Gloo's worker thread lets go of a collective's work
    just after `wait()` has returned, freeing tensors Python saw, for which it needs the GIL. A rank with
    little left to do can reach the interpreter's teardown first; the thread then cannot take the GIL
    and the process aborts ("terminate called without an active exception", pytorch/pytorch#190489;
    about one two-rank launch in ten of tests/convert_fixtures/train_tiny.py). Destroying the groups
    does not stop those threads while DeepSpeed still holds the groups. A barrier completes only after
    the group's earlier work, so by then the threads have let go of it, unless one was kept waiting for
    a core: exit_without_teardown covers that."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if not (dist.is_available() and dist.is_initialized()):
        return
    for group in list(c10d._world.pg_map):
        if dist.get_backend(group) == "gloo":
            dist.barrier(group=group)
    dist.destroy_process_group()


def exit_without_teardown(code: int) -> None:
    """End the rank's process with `code` as Python's own exit would (other threads joined, atexit
    handlers run, output flushed), but without the interpreter's teardown, where a gloo worker thread
    still letting go of a collective's tensors aborts the process (close_process_groups) and the
    launcher then reports a finished run as failed."""
    import atexit
    import threading

    # What the interpreter's exit runs before its teardown, in its order: threading's exit callbacks
    # (which tell thread pools' idle workers to stop) and the join of other non-daemon threads, then
    # the atexit handlers (DeepSpeed's, the trackers', logging's flush).
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def end_rank(code: int = 0) -> None:
    """End a process whose collectives are all over, as dstrain's ranks end (for scripts that start
    ranks of their own: test fixtures, benchmarks): process groups closed, no interpreter teardown."""
    close_process_groups()
    exit_without_teardown(code)


def quiet_logging(verbose: bool) -> None:
    """DeepSpeed's own logging at warning level unless --verbose; known-harmless warnings hidden."""
    if verbose:
        return
    from deepspeed.utils import logger as ds_logger
    ds_logger.setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*")
    warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor.*")
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")


def seed_everything(seed: int) -> None:
    """Same seed on every rank: identical initial weights (stage 0-2 ranks build the model alone)."""
    import random
    import numpy as np
    import torch
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def initialize_engine(model, ds_config: dict, speedups=None, mpu=None):
    """deepspeed.initialize over the model's trainable parameters, as the worker and `dstrain eval` build
    their engines, with dstrain's changes that act while an engine is built (`speedups`: the config's
    section; dstrain/speedups/); `mpu`: the sequence-parallel groups (dstrain.rank.sequence_parallel)."""
    import deepspeed

    from dstrain.speedups import building_engine
    with building_engine(speedups):
        engine, _, _, _ = deepspeed.initialize(model=model, config=ds_config, mpu=mpu,
                                               model_parameters=[p for p in model.parameters() if p.requires_grad])
    return engine


def sequence_parallel_mpu(model, config, ds_config: dict):
    """With train.sequence_parallel > 1, DeepSpeed's Ulysses attention in `model` and the mpu that
    deepspeed.initialize takes (dstrain.rank.sequence_parallel); None otherwise."""
    if config.train.sequence_parallel == 1:
        return None
    from dstrain.rank.sequence_parallel import enable
    return enable(model, config, ds_config)


def checkpointing_wanted(config, ds_config: dict, model, device) -> tuple[bool, str | None]:
    """Whether this rank checkpoints activations: train.activation_checkpointing, or for "auto" the memory
    estimate's decision for this rank's device and its job's layout (planner.checkpointing_decision),
    with why (None where the user chose)."""
    if config.train.activation_checkpointing != "auto":
        return bool(config.train.activation_checkpointing), None
    from dataclasses import replace

    from dstrain.models import model_shape, parameter_counts
    from dstrain.tools.estimate.memory import detect_hardware
    from dstrain.tools.estimate.planner import checkpointing_decision

    total, largest = parameter_counts(model)
    hw = detect_hardware()  # the smallest visible GPU: a node's ranks decide alike
    if device.type != "cuda":  # CPU ranks share the host's RAM
        hw = replace(hw, gpu_mem_bytes=hw.cpu_mem_bytes, accelerator="cpu")
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    hw = replace(hw, gpus_per_node=per_node, nodes=max(1, int(os.environ.get("WORLD_SIZE", "1")) // per_node))
    return checkpointing_decision(config, ds_config, total, largest, hw, model_shape(model, config))


def apply_tiled_mlp(model, config) -> str | None:
    """train.tiled_mlp: each decoder layer's MLP run in shards along the sequence (dstrain.models.tiled_mlp),
    before DeepSpeed wraps the model. A line for rank 0 to print, or None where it is off."""
    if config.train.tiled_mlp is not True:
        return None
    from dstrain.models import tiled_mlp
    tokens = config.data.seq_len // config.train.sequence_parallel  # one sample's tokens on this rank
    shards = config.train.tiled_mlp_shards or tiled_mlp.auto_shards(tokens, tiled_mlp.hidden_size(model.model) or tokens)
    mlps = tiled_mlp.apply(model, shards)
    how = "train.tiled_mlp_shards" if config.train.tiled_mlp_shards else "ceil(tokens / hidden_size)"
    return (f"tiled MLP: {len(mlps)} {type(mlps[0]).__name__ if mlps else 'MLP'} layers each run over {tokens:,} "
            f"tokens per sample in {shards} shards ({how}), recomputed in backward")


def activation_offload(config) -> Callable[[], Any]:
    """train.activation_checkpointing_offload: the context each micro batch's forward and backward run in.
    DeepSpeed's manager marks the input of each transformers layer that checkpoints (GradientCheckpointingLayer)
    and keeps it in pinned host memory until backward needs it (the newest layer's stays on the GPU); other
    saved tensors are untouched. One manager for the run, so its pinned buffers are reused step after step;
    without activation checkpointing nothing is marked and it changes nothing."""
    if not config.train.activation_checkpointing_offload:
        return contextlib.nullcontext
    from deepspeed.runtime.activation_checkpointing.offload_activations import (
        get_checkpoint_hidden_states_offloading_ctx_manager)
    manager = get_checkpoint_hidden_states_offloading_ctx_manager()
    return lambda: manager


def enable_activation_checkpointing(model, ds_config: dict, rank: int) -> None:
    import deepspeed
    options = ds_config.get("activation_checkpointing") or {}
    deepspeed.checkpointing.configure(
        None, partition_activations=options.get("partition_activations", False),
        contiguous_checkpointing=options.get("contiguous_memory_optimization", False),
        num_checkpoints=options.get("number_checkpoints"), checkpoint_in_cpu=options.get("cpu_checkpointing", False),
        synchronize=options.get("synchronize_checkpoint_boundary", False), profile=options.get("profile", False))
    if hasattr(model, "enable_checkpointing"):
        model.enable_checkpointing(deepspeed.checkpointing.checkpoint)
    elif rank == 0:
        print("warning: train.activation_checkpointing is on, but the model has no enable_checkpointing(fn) "
              "method; it runs without checkpointing", file=sys.stderr)


def compile_engine(engine, ds_config: dict, world: int) -> str | None:
    """Compile the model after any checkpoint is loaded; a line for rank 0 to print, or None.

    An hf: model without DeepCompile is compiled region by region (compile_hf_blocks): each decoder
    block on its own, at every stage. Any other model: engine.compile(). With DeepCompile, dstrain hands DeepSpeed the
    pass schedule itself, for two reasons (docs/benchmarks.md, finding 32):
    - DeepSpeed's schedule starts at global step 0 and a resumed run starts later, so it never
      started: the first step after a resume failed (its passes were None). Here it starts at the
      step the run starts at.
    - ZeRO-3 on one GPU: only the gather/release pass. DeepSpeed's default adds, 5 steps in, prefetch and
      selective-gather passes planned from a profile, which cost a second compile (99.6 s on the
      406M GPT, one H100) and measured no faster there (88,146 against 83,929 tokens/s, inside the
      spread): one rank's gather is a local copy, nothing to prefetch. Several GPUs keep them.
    A `compile.passes`, an offload pass or offloaded parameters keep DeepSpeed's own schedule."""
    section = ds_config.get("compile") or {}
    zero = ds_config.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    # DeepSpeed turns its parameter-offload pass on by itself when ZeRO offloads the parameters
    own_schedule = section.get("passes") or (zero.get("offload_param") or {}).get("device", "none") != "none" or any(
        section.get(key) for key in ("offload_parameters", "offload_opt_states", "offload_activation"))
    if section.get("deepcompile") is not True:
        from dstrain.models.hf import CausalLM
        if isinstance(engine.module, CausalLM):
            return compile_hf_blocks(engine.module, stage)
    if section.get("deepcompile") is not True and stage == 3 and compile_zero3_leaf_modules(engine):
        return None
    if section.get("deepcompile") is not True or stage not in (1, 2, 3) or own_schedule:
        engine.compile()
        return None
    from deepspeed.compile.init_z3 import WARMUP
    from deepspeed.compile.passes import prefetch, selective_gather, zero3_compile
    start = engine.global_steps
    if stage in (1, 2):  # DeepSpeed's own ZeRO-1/2 schedule, one pass from the start
        passes = zero_1_and_2_passes()
        reduce = passes.add_z1_reduce if stage == 1 else passes.add_z2_reduce
        engine.compile(schedule=[(start, [reduce])])
        return None
    schedule = [(start, [zero3_compile.add_z3_gather_release])]
    if world > 1:
        schedule.append((start + WARMUP, [zero3_compile.add_z3_gather_release, prefetch.schedule_prefetch,
                                          selective_gather.selective_gather]))
    engine.compile(schedule=schedule)
    return None


def compile_hf_blocks(model, stage: int) -> str:
    """Regional compilation of an hf: model (as torchtitan compiles its blocks): each decoder layer's
    forward compiled on its own, dynamic=False; the embedding, rotary table, mask, final norm, head and
    loss stay eager. What it did, or why it left the model eager, as one line.

    Why per block: every layer runs the same code on same-shaped inputs, so dynamo traces one graph and
    the other layers reuse it (one compile, not one per layer: the first step stays short), and the
    forward is compiled, not the module's call, so DeepSpeed's ZeRO-3 hooks on a leaf module (dstrain
    makes each decoder layer one) run eagerly around the graph, never inside it. A Llama or Qwen2 layer
    traces as one graph with no breaks (transformers 5.x: the attention dispatch, the rotary
    `position_embeddings` tuple, a None cache and mask; tests/test_hf_compile.py).
    ZeRO-3 where the layers are not leaf modules (LoRA: a frozen base keeps DeepSpeed's per-linear
    hooks) stays eager: those hooks would fall inside each block's graph and break it."""
    import torch
    from dstrain.models.hf import decoder_blocks

    blocks = decoder_blocks(model)
    if not blocks:
        return ("compile: left eager: the model names no decoder-layer class (_no_split_modules) in a "
                "ModuleList to compile one by one")
    name = type(blocks[0]).__name__
    if stage == 3:
        from deepspeed.utils import z3_leaf_module
        if not all(z3_leaf_module(block) for block in blocks):
            return (f"compile: left eager: at ZeRO-3 each {name} must be a leaf module (one fetch) to compile "
                    "without DeepSpeed's per-layer hooks inside its graph; it is not (LoRA, or a "
                    "leaf_module setting of your own)")
    for block in blocks:
        block.forward = torch.compile(block.forward, dynamic=False)
    return f"compile: {len(blocks)} {name} blocks compiled one by one (regional); the rest of the model stays eager"


def zero_1_and_2_passes():
    """DeepCompile's ZeRO-1/2 module of passes: zero_1_and_2_compile since DeepSpeed 0.19, zero1_compile
    (the same add_z1_reduce and add_z2_reduce) before."""
    try:
        from deepspeed.compile.passes import zero_1_and_2_compile
        return zero_1_and_2_compile
    except ImportError:
        from deepspeed.compile.passes import zero1_compile
        return zero1_compile


def compile_zero3_leaf_modules(engine) -> int:
    """ZeRO-3 without DeepCompile: compile the forward of each ZeRO-3 leaf module (a transformer block,
    fetched as one unit) instead of the whole model; how many were compiled (0: none, nothing changed).
    DeepSpeed's hooks that gather, release and reduce a leaf's parameters run in the module's call, around
    its forward, so they stay eager and outside the graph; compiling the whole model put them inside it,
    where they break the graph (finding 11: 0.52x of eager). Every block is one graph: the parameters are
    graph inputs, so a freshly gathered weight is taken as it is."""
    import torch
    from deepspeed.utils import z3_leaf_module

    leaves = [m for m in engine.module.modules() if m is not engine.module and z3_leaf_module(m)]
    for module in leaves:
        module.forward = torch.compile(module.forward)
    return len(leaves)
