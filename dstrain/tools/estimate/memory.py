"""Memory arithmetic for each ZeRO preset: GPU, host RAM and NVMe, before anything is launched.

`dstrain estimate` runs `estimate_one` for every preset (fastest first: stage1, stage2,
stage3, stage2_offload, stage3_offload, stage3_nvme) and `recommend` picks the fastest that
fits. Everything here is plain arithmetic on dataclasses: importing this module never imports
torch or deepspeed (only `detect_hardware` imports torch, lazily; counting a model is
dstrain.models.count_model), so the
estimate runs on a laptop.

Notation: P parameters, N = gpus_per_node * nodes data-parallel ranks, n = P / N (one rank's
partition), L = parameters of the largest single module, w = bytes of one low-precision
element (2 for bf16/fp16, 4 for fp32). All figures are bytes.

Model states, per rank (sources below):

    term (bf16/fp16)            stage 0   stage 1   stage 2   stage 3     where it lives
    16-bit params               2P        2P        2P        2n          GPU; host/NVMe with offload_param (stage 3)
    16-bit grads                2P        2P        2n        2n          GPU; with offload_optimizer: none (stage 2),
                                                                          host (stage 3)
    fp32 grad partition         4P        4n        4n        4*min(n,S)  GPU; host/NVMe with offload_optimizer
    fp32 master + Adam m, v     12P       12n       12n       12n         GPU; host/NVMe with offload_optimizer

  (S = sub_group_size: stage 3 builds the fp32 gradients one optimizer sub-group at a time.)

- ZeRO paper (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
  Parameter Models", figure 1 and sec. 5.1), mixed-precision Adam, K = 12:
  stage 1 = 4P + 12P/N, stage 2 = 2P + 14P/N, stage 3 = 16P/N.
- DeepSpeed also materialises an fp32 copy of each rank's gradient partition for the optimizer
  step (stage_1_and_2.py: `single_partition_of_fp32_groups[i].grad = flat_grad_partition.to(fp32)`;
  stage3.py: `_prepare_fp32_grad_for_sub_group`), and ZeRO-3 keeps its 16-bit gradient partition in
  `grad_partitions_flat_buffer` (dtype = grad_accum_dtype, the model dtype by default). So our
  figures are the paper's plus 4 bytes per partitioned parameter: stage 1 = 4P + 16P/N,
  stage 2 = 2P + 18P/N, stage 3 = 20P/N (while n <= sub_group_size).
- DeepSpeed's `estimate_zero2_model_states_mem_needs` (stage_1_and_2.py) gives the same 2P + 18P/N
  ("18 = 2_grads_16bit + 4_grads_32bit + 4_params_32bit + 8_optimizer_states_32bit").
  `estimate_zero3_model_states_mem_needs` (stage3.py) gives 18P/N + 4L: it leaves out one of the
  two gradient copies, so we are 2P/N above it (about 11%). It has no stage 1 estimator.
- fp32 training (neither bf16 nor fp16 enabled): params and grads take 4 bytes. DeepSpeed still
  clones an fp32 master partition (`.detach().clone().to(master dtype)`) and still flattens the
  gradient partition into a new tensor for the step, so the other terms stay:
  stage 1 = 8P + 16P/N, stage 2 = 4P + 20P/N, stage 3 = 24P/N.

Offload (DeepSpeed's estimators, same files):
- offload_optimizer=cpu moves the fp32 grad partition, master and Adam states to the host: 16 bytes
  per parameter of the node's share, 16P / nodes, as DeepSpeed's estimators say. The code also pins
  a 16-bit copy of each partition there, which the estimators leave out: ZeRO-2's staging buffer
  for the updated weights (`param_buffer_of_bit16_for_cpu_offload_groups`) and ZeRO-3's gradient
  partition (`grad_partitions_flat_buffer`), so we count 18P / nodes; stage 3 with
  offload_param=cpu adds the 16-bit parameter partition: 20P / nodes (DeepSpeed: 18P).
  Host model states are multiplied by DeepSpeed's `additional_buffer_factor` = 1.5 (pinned
  allocations and fragmentation).
- While building the model, every rank holds a full fp32 copy on the host (4P per rank) unless
  stage 3 builds under `deepspeed.zero.Init` (then about one module at a time: 4L per rank).
  DeepSpeed's estimators count this as `4 * gpus_per_node * P * 1.5`; it is freed before the
  optimizer states exist, so host = runtime + max(model build, steady state).
- NVMe (stage3_nvme): the optimizer terms (4n + 12n) and, with offload_param=nvme, the 16-bit
  partition (wn) live in swap files; the host keeps pinned swap buffers: `buffer_count` buffers of
  the largest optimizer sub-group (min(sub_group_size, n) fp32 elements) and `buffer_count *
  buffer_size` 16-bit elements for parameters, plus up to `max_in_cpu` parameters cached in RAM
  (deepspeed/runtime/swap_tensor/*, stage3.py `_create_param_groups_fp16_flat_cpu_memory`).

Working buffers on the GPU:
- stage 3 gathers whole modules before use: 4L (16-bit params + grads of the largest layer,
  DeepSpeed's `largest_layer_memory`), plus more gathered parameters kept live up to
  `stage3_max_live_parameters` (prefetched parameters count towards that limit, so
  `stage3_prefetch_bucket_size` adds nothing on top). Small persistent parameters
  (`stage3_param_persistence_threshold` at DeepSpeed's 1e5) are a few MB for a GPT and are not counted;
  a larger threshold (dstrain's for a small built-in GPT keeps every block whole) is: those parameters
  cost 2 bytes each on every GPU instead of 2/N.
- ZeRO-1/2 with offload_optimizer=cpu: dstrain's offload step sends each chunk of updated fp32
  weights to a GPU staging buffer and rounds it to bf16 there: 4 bytes x min(8M, P), 32 MiB at most.
- ZeRO-2/3 with offload_optimizer=cpu and gradient accumulation: dstrain sums the gradients on the GPU
  between micro steps (speedups.offload_accumulate), a rank's share in the model's dtype (w * n), where
  that leaves a quarter of the GPU free before activations (auto's rule on the ranks), on CUDA only.
- ZeRO-3 with the parameters on the CPU and gradient accumulation: dstrain keeps the gathered weights on
  the GPU through the window (speedups.offload_keep_weights), the whole model in the model's dtype
  (w * P, less the live window above), by the same rule after the sums.
- gradient reduction buckets with contiguous_gradients: `reduce_bucket_size` elements of w bytes,
  two of them for stage 1/2 with overlap_comm (stage_1_and_2.py `setup_buckets`), one for stage 3.
- a fixed runtime overhead: CUDA context, cuBLAS workspaces, NCCL communicators and allocator
  slack, counted as GPU_RUNTIME_OVERHEAD_BYTES = 1 GiB (typically 0.5-1.5 GiB per GPU).

Activations per GPU, GPT block with hidden size h, a heads, sequence s, micro batch b
(Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
eq. 1, no tensor/sequence parallelism): s*b*h*(34 + 5*a*s/h) bytes per layer in 16 bit.
- The 5*a*s^2*b part is the attention score matrix. We assume flash / SDPA attention by default
  (scores are recomputed in backward; only a logsumexp of 4*a*s*b bytes is kept), so it is dropped;
  `Workload.flash_attention=False` brings it back.
- The 34*s*b*h keeps ~2*s*b*h of dropout masks that vanish with dropout 0: a small overestimate.
- fp32 doubles it.
- Activation checkpointing keeps only each block's input (2*s*b*h per layer, moved to host with
  cpu_checkpointing) plus one block's full activations while it is recomputed.
- The logits, whole (train.loss_chunking off): 12*b*s*vocab bytes. The loss keeps the fp32
  log-probabilities (4 bytes a logit) for backward, and at the backward's start, with every activation
  still held, the fp32 gradients w.r.t. them and w.r.t. the logits (4 + 4) exist beside them; the
  compute-dtype logits and their fp32 copy (w + 4) come and go in the forward, below that peak.
- The logits in chunks of c tokens (dstrain/models/chunked_loss.py, c' = min(c, b*s)): one chunk's
  logits, fp32 probabilities and gradient, c'*vocab*(4 + 2w), plus the head's weight gradient, summed
  in fp32 over the chunks and kept in its dtype for backward, vocab*d*(4 + w), plus the hidden
  states' gradient, b*s*d*w.
- Tiled MLP (train.tiled_mlp, DeepSpeed's TiledMLP): of the block's 34*s*b*h, the MLP's own 19*s*b*h
  (its input 2, the 4h-wide pre- and post-activation 8 + 8, the dropout mask 1) shrinks to its input (2):
  17*s*b*h a layer, plus one shard's MLP activations, 19*(s/k)*b*h, while that shard is computed or
  recomputed (k shards: train.tiled_mlp_shards, or ceil(s / h) as dstrain uses by default).
- Checkpoint offload (train.activation_checkpointing_offload, "hf:" models): the checkpointed block
  inputs are on the host, as with cpu_checkpointing (DeepSpeed keeps the newest one on the GPU: not counted).
- Sequence parallelism over N ranks (train.sequence_parallel, DeepSpeed's Ulysses): each GPU holds s/N
  tokens of every activation above, logits included (whole or chunked); the core attention runs over the whole sequence
  for a/N heads, so the score matrix (without flash attention) is 5*(a/N)*s^2*b. The model states are
  sharded over all ranks as before (ZeRO partitions over the data- and sequence-parallel ranks together).

Fits: GPU bytes <= 90% of GPU memory (GPU_HEADROOM, for fragmentation and the transient peaks
not modelled), host bytes <= host RAM, NVMe bytes <= `Hardware.nvme_free_bytes` when known.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, replace

from dstrain.config.fp8 import weight_precision
from dstrain.errors import Problem, UserError

GiB = 1024**3


GPU_HEADROOM = 0.9
# dstrain/speedups/offload_accumulate_zero12.py's AUTO_HEADROOM (tools may not import the rank side; a test
# keeps the two equal): auto makes the GPU gradient sums only where they leave this share of the GPU free.
OFFLOAD_SUMS_HEADROOM = 0.25
"""Fraction of GPU memory a preset may plan to use: fragmentation and transient peaks take the rest."""

GPU_RUNTIME_OVERHEAD_BYTES = 1 * GiB
"""CUDA context, library workspaces, NCCL communicators: present before the first tensor."""

HOST_RUNTIME_BYTES_PER_RANK = 2 * GiB
"""Resident memory of one rank's Python + torch + CUDA/NCCL libraries, before any model (rough)."""

HOST_BUFFER_FACTOR = 1.5
"""DeepSpeed's `additional_buffer_factor` for host-side model states (pinned memory, fragmentation)."""

BUILD_BYTES_PER_PARAM = 4
"""A model is built in fp32 on the host before DeepSpeed casts and moves it (PyTorch default dtype)."""

# dstrain/speedups/offload_chunked_step.py's DEFAULT_CHUNK_ELEMENTS (tools may not import the rank side; a test
# keeps the two equal): the offload steps' GPU staging buffers hold one chunk.
OFFLOAD_STEP_CHUNK_ELEMENTS = 1 << 23

ADAM_FP32_BYTES_PER_PARAM = 12
"""fp32 master weights + Adam momentum + variance (ZeRO paper's K = 12)."""

FP32_GRAD_BYTES_PER_PARAM = 4

PRECISIONS = ("bf16", "fp16", "fp32")
DEVICES = ("none", "cpu", "nvme")


@dataclass
class Hardware:
    """What the job runs on."""

    gpus_per_node: int
    nodes: int
    gpu_mem_bytes: int
    """Memory of one GPU (the smallest, if they differ)."""
    cpu_mem_bytes: int
    """Host RAM of one node."""
    nvme_free_bytes: int | None = None
    """Free space at each node's nvme_path; None = unknown, NVMe is then assumed to fit."""
    accelerator: str = "cuda"
    """"cuda", or "cpu" when DeepSpeed's CPU accelerator runs the ranks in host RAM."""

    @property
    def total_gpus(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass
class Workload:
    """The model and batch being trained: what the memory depends on besides the ZeRO placement."""

    params: int
    largest_layer_params: int
    """Direct parameters of the largest single module (the embedding, in most GPTs)."""
    n_layer: int
    d_model: int
    n_head: int
    seq_len: int
    micro_batch: int
    """Sequences per GPU per forward pass."""
    activation_checkpointing: bool
    cpu_checkpointing: bool
    """Checkpointed block inputs go to host RAM (DeepSpeed activation checkpointing)."""
    precision: str
    """"bf16", "fp16" or "fp32"; a DeepSpeed config's own bf16/fp16 section takes precedence."""
    vocab_size: int = 50257
    """For the logits term; GPT-2's vocabulary by default."""
    loss_chunk_tokens: int | None = None
    """train.loss_chunking's tokens per chunk where the LM loss runs in chunks; None: the whole logits."""
    flash_attention: bool = True
    """Attention via SDPA/flash: the s^2 score matrix is not stored."""
    sequence_parallel: int = 1
    """Ranks that split each sequence (train.sequence_parallel): each GPU holds seq_len / N tokens."""
    tiled_mlp: bool = False
    """train.tiled_mlp: each block's MLP runs in shards along the sequence, its activations recomputed."""
    tiled_mlp_shards: int | None = None
    """train.tiled_mlp_shards; None: ceil(tokens per GPU per sequence / d_model)."""
    zero_init: bool = True
    """Stage 3 builds the model under deepspeed.zero.Init (partitioned as it is built)."""
    layer_params: int | None = None
    """An hf: model's decoder layers' parameters, all of them (None: the built-in GPT's shape counts)..."""
    layer_largest: int | None = None
    """... and their largest single parameter: a persistence threshold at or above it keeps them whole."""
    grad_accum_steps: int = 1
    """train.grad_accum_steps: with the optimizer offloaded, dstrain may sum the gradients on the GPU."""
    offload_accumulate: str | bool = "auto"
    """speedups.offload_accumulate: whether those sums may live on the GPU (auto: where they leave room)."""
    offload_keep_weights: str | bool = "auto"
    """speedups.offload_keep_weights: whether ZeRO-3 keeps the offloaded weights gathered through a window."""
    inactive_params: int = 0
    """A mixture-of-experts model's routed experts' parameters a token does not run through: memory holds all
    `params`, compute runs `active_params`."""

    @property
    def active_params(self) -> int:
        return self.params - self.inactive_params


@dataclass
class Placement:
    """Where ZeRO puts the model states, and the buffer sizes that matter for memory.

    Defaults are DeepSpeed's own (deepspeed/runtime/zero/config.py, offload_config.py).
    """

    stage: int
    offload_optimizer: str = "none"
    offload_param: str = "none"
    """Honoured by stage 3 only, as in DeepSpeed."""
    precision: str | None = None
    """From the DeepSpeed config's bf16/fp16 sections; None = use Workload.precision."""
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    """All-gathers run in place on the 16-bit buffer: recorded, adds no memory here."""
    overlap_comm: bool | None = None
    """None = DeepSpeed's default: on for stage 3, off otherwise."""
    contiguous_gradients: bool = True
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 100_000  # DeepSpeed's default (DEEPSPEED_PERSISTENCE_THRESHOLD)
    """Stage 3 keeps parameters of up to this many elements whole on every rank."""
    sub_group_size: int = 1_000_000_000
    optimizer_buffer_count: int = 4
    """offload_optimizer.buffer_count: pinned swap buffers for NVMe."""
    param_buffer_count: int = 5
    """offload_param.buffer_count."""
    param_buffer_size: int = 100_000_000
    """offload_param.buffer_size, in elements."""
    param_max_in_cpu: int = 1_000_000_000
    """offload_param.max_in_cpu: parameters cached in host RAM with NVMe offload."""


@dataclass
class PresetEstimate:
    """Memory needs of one preset. `*_breakdown` maps group -> term -> bytes, where the groups
    are "model_states", "buffers", "activations", "runtime" and "model_build" (the model as first
    built: on the host, or on the GPU for stages 0-2 with CUDA; the total counts it or the steady
    state, whichever is larger)."""

    name: str
    placement: Placement
    gpu_bytes_per_gpu: int
    cpu_bytes_per_node: int
    nvme_bytes: int
    """Per node (each node swaps to its own nvme_path)."""
    activation_bytes_per_gpu: int
    model_state_bytes_per_gpu: int
    buffer_bytes_per_gpu: int
    fits: bool
    why: str
    """What does not fit, or, when it fits, the tightest resource."""
    gpu_breakdown: dict[str, dict[str, int]] = field(default_factory=dict)
    cpu_breakdown: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per node. Total = runtime + max(model_build, everything else)."""
    nvme_breakdown: dict[str, dict[str, int]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- DeepSpeed config


def _size_setting(section: dict, keys: tuple[str, ...], path: str, default: int, problems: list[Problem]) -> int:
    """The first of `keys` present in `section` as a non-negative int, else `default`; a value the
    estimate cannot use (e.g. "auto") is a problem."""
    for key in keys:
        if key in section:
            value = section[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                problems.append(Problem(f"{value!r} is not a non-negative number", f"{path}.{key}",
                                        "set a number of elements; the estimate needs concrete sizes"))
                return default
            return int(value)
    return default


def _offload_device(section: dict | None, path: str, problems: list[Problem]) -> str:
    if not section:
        return "none"
    value = str(section.get("device") or "none").lower()
    if value not in DEVICES:
        problems.append(Problem(f"unknown offload device {value!r}", f"{path}.device", "use one of: none, cpu, nvme"))
        return "none"
    return value


def placement_from_ds_config(ds: dict) -> Placement:
    """Read the ZeRO placement from a rendered DeepSpeed config dict.

    Absent keys take DeepSpeed's defaults (the `Placement` defaults). Raises UserError listing
    every key whose value cannot be used (e.g. "auto", an unknown offload device).
    """
    problems: list[Problem] = []
    zero = ds.get("zero_optimization") or {}

    def number(section: dict, keys: tuple[str, ...], path: str, default: int) -> int:
        return _size_setting(section, keys, path, default, problems)

    def device(section: dict | None, path: str) -> str:
        return _offload_device(section, path, problems)

    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        problems.append(Problem(f"ZeRO stage {stage!r} is not 0, 1, 2 or 3", "zero_optimization.stage"))
        stage = 0

    opt_section = zero.get("offload_optimizer")
    param_section = zero.get("offload_param")
    offload_optimizer = device(opt_section, "zero_optimization.offload_optimizer")
    offload_param = device(param_section, "zero_optimization.offload_param")
    # Deprecated spellings DeepSpeed still accepts.
    if zero.get("cpu_offload") and offload_optimizer == "none":
        offload_optimizer = "cpu"
    if zero.get("cpu_offload_param") and offload_param == "none":
        offload_param = "cpu"

    bf16 = ds.get("bf16", ds.get("bfloat16")) or {}
    fp16 = ds.get("fp16") or {}
    precision = "bf16" if bf16.get("enabled") else "fp16" if fp16.get("enabled") else "fp32"

    overlap = zero.get("overlap_comm")
    defaults = Placement(stage=stage)
    z = "zero_optimization"
    opt_section = opt_section or {}
    param_section = param_section or {}
    placement = Placement(
        stage=stage,
        offload_optimizer=offload_optimizer,
        offload_param=offload_param,
        precision=precision,
        reduce_bucket_size=number(zero, ("reduce_bucket_size",), z, defaults.reduce_bucket_size),
        allgather_bucket_size=number(zero, ("allgather_bucket_size",), z, defaults.allgather_bucket_size),
        overlap_comm=None if overlap is None else bool(overlap),
        contiguous_gradients=bool(zero.get("contiguous_gradients", defaults.contiguous_gradients)),
        stage3_max_live_parameters=number(zero, ("stage3_max_live_parameters", "max_live_parameters"), z,
                                          defaults.stage3_max_live_parameters),
        stage3_prefetch_bucket_size=number(zero, ("stage3_prefetch_bucket_size", "prefetch_bucket_size"), z,
                                           defaults.stage3_prefetch_bucket_size),
        stage3_param_persistence_threshold=number(zero, ("stage3_param_persistence_threshold",
                                                         "param_persistence_threshold"), z,
                                                  defaults.stage3_param_persistence_threshold),
        sub_group_size=number(zero, ("sub_group_size",), z, defaults.sub_group_size),
        optimizer_buffer_count=number(opt_section, ("buffer_count",), f"{z}.offload_optimizer",
                                      defaults.optimizer_buffer_count),
        param_buffer_count=number(param_section, ("buffer_count",), f"{z}.offload_param",
                                  defaults.param_buffer_count),
        param_buffer_size=number(param_section, ("buffer_size",), f"{z}.offload_param",
                                 defaults.param_buffer_size),
        param_max_in_cpu=number(param_section, ("max_in_cpu",), f"{z}.offload_param", defaults.param_max_in_cpu),
    )
    if problems:
        raise UserError(problems)
    return placement


# --------------------------------------------------------------------------- the arithmetic


def _check_inputs(placement: Placement, work: Workload, hw: Hardware) -> None:
    problems: list[Problem] = []
    for name in ("params", "n_layer", "d_model", "n_head", "seq_len", "micro_batch", "vocab_size", "sequence_parallel"):
        if getattr(work, name) <= 0:
            problems.append(Problem(f"must be positive, got {getattr(work, name)}", f"workload.{name}"))
    if work.loss_chunk_tokens is not None and work.loss_chunk_tokens <= 0:
        problems.append(Problem(f"must be positive or None, got {work.loss_chunk_tokens}", "workload.loss_chunk_tokens"))
    if not 0 <= work.largest_layer_params <= work.params:
        problems.append(Problem(f"must be between 0 and params ({work.params}), got {work.largest_layer_params}",
                                "workload.largest_layer_params"))
    if work.precision not in PRECISIONS:
        problems.append(Problem(f"unknown precision {work.precision!r}", "workload.precision",
                                "use one of: " + ", ".join(PRECISIONS)))
    for name in ("gpus_per_node", "nodes", "gpu_mem_bytes", "cpu_mem_bytes"):
        if getattr(hw, name) <= 0:
            problems.append(Problem(f"must be positive, got {getattr(hw, name)}", f"hardware.{name}"))
    if placement.stage not in (0, 1, 2, 3):
        problems.append(Problem(f"ZeRO stage {placement.stage!r} is not 0, 1, 2 or 3", "placement.stage"))
    for name in ("offload_optimizer", "offload_param"):
        if getattr(placement, name) not in DEVICES:
            problems.append(Problem(f"unknown device {getattr(placement, name)!r}", f"placement.{name}",
                                    "use one of: " + ", ".join(DEVICES)))
    if problems:
        raise UserError(problems)


def _activations(work: Workload, low_bytes: int) -> tuple[dict[str, int], dict[str, int]]:
    """Activation bytes per GPU and per rank on the host (Korthikanti et al. 2022, see module doc)."""
    s, b, h, a = work.seq_len, work.micro_batch, work.d_model, work.n_head
    sp = work.sequence_parallel
    local = s // sp  # this GPU's tokens of each sequence
    scale = low_bytes / 2  # the formula is in 16-bit bytes; fp32 doubles it
    per_layer = 34 * local * b * h
    shard_mlp = 0
    if work.tiled_mlp:  # the MLP keeps its input only; one shard's activations at a time
        shards = min(local, work.tiled_mlp_shards or -(-local // h))
        per_layer -= 17 * local * b * h
        shard_mlp = int(19 * -(-local // shards) * b * h * low_bytes / 2)
    if not work.flash_attention:
        per_layer += 5 * a * s * s * b // sp  # a/N heads over the whole sequence
    per_layer = int(per_layer * scale)
    logits = _logits_bytes(work, low_bytes)
    s = local
    gpu: dict[str, int] = {}
    host: dict[str, int] = {}
    if work.activation_checkpointing:
        block_inputs = int(2 * s * b * h * scale) * work.n_layer
        (host if work.cpu_checkpointing else gpu)["checkpointed_block_inputs"] = block_inputs
        gpu["recomputed_block"] = per_layer
    else:
        gpu["all_blocks"] = per_layer * work.n_layer
    if shard_mlp:
        gpu["tiled_mlp_shard"] = shard_mlp
    gpu["logits"] = logits
    return gpu, host


def _logits_bytes(work: Workload, low_bytes: int) -> int:
    """The LM loss's own memory at its peak, whole or in chunks (see the module docstring)."""
    tokens, vocab = work.micro_batch * (work.seq_len // work.sequence_parallel), work.vocab_size  # this GPU's
    if work.loss_chunk_tokens is None:
        return 12 * tokens * vocab
    chunk = min(work.loss_chunk_tokens, tokens)
    return chunk * vocab * (4 + 2 * low_bytes) + vocab * work.d_model * (4 + low_bytes) + tokens * work.d_model * low_bytes


def workload(cfg, ds_config: dict, total: int, largest: int, activation_checkpointing: bool, shape: dict | None = None):
    """The estimate's Workload for a resolved run config whose model has `total` parameters. `shape`
    (dstrain.models.model_shape of the built model: layers, width, heads, vocabulary, loss chunk) replaces
    the built-in GPT's model.* fields, which an hf: model does not read."""
    ac = ds_config.get("activation_checkpointing") or {}
    chunk = cfg.train.loss_chunk_tokens if cfg.train.loss_chunking is True else None
    m = cfg.model
    fields = dict(n_layer=m.n_layer, d_model=m.d_model, n_head=m.n_head, vocab_size=m.vocab_size, loss_chunk_tokens=chunk)
    fields.update(shape or {})
    return Workload(params=total, largest_layer_params=largest, seq_len=cfg.data.seq_len,
                    micro_batch=cfg.train.micro_batch_size, activation_checkpointing=activation_checkpointing,
                    # train.activation_checkpointing_offload puts an hf: model's block inputs on the host too
                    cpu_checkpointing=bool(ac.get("cpu_checkpointing") or cfg.train.activation_checkpointing_offload),
                    # fp8 trains bf16 weights and keeps bf16 activations (torchao saves the bf16 inputs)
                    precision=weight_precision(cfg.train.precision), sequence_parallel=cfg.train.sequence_parallel,
                    tiled_mlp=cfg.train.tiled_mlp is True, tiled_mlp_shards=cfg.train.tiled_mlp_shards,
                    grad_accum_steps=cfg.train.grad_accum_steps, offload_accumulate=cfg.speedups.offload_accumulate,
                    offload_keep_weights=cfg.speedups.offload_keep_weights,
                    **fields)


def estimate_one(name: str, placement: Placement, work: Workload, hw: Hardware) -> PresetEstimate:
    """Estimate GPU (per GPU), host (per node) and NVMe (per node) bytes for one placement.

    The placement's precision (from the DeepSpeed config, which is what will run) wins over
    `work.precision`. Raises UserError for impossible inputs (non-positive sizes, unknown names).
    """
    _check_inputs(placement, work, hw)
    notes = _placement_notes(placement, hw)
    precision = placement.precision or work.precision
    w = 2 if precision in ("bf16", "fp16") else 4
    states = _model_states(placement, work.params, -(-work.params // hw.total_gpus), w)
    if (placement.stage == 3 and placement.offload_param == "none"
            and placement.stage3_param_persistence_threshold > DEEPSPEED_PERSISTENCE_THRESHOLD):
        # Persistent parameters are whole on every rank, not a shard: what they add over it (DeepSpeed's
        # default keeps a few MB of LayerNorms whole, left out as the formulas above say).
        threshold = placement.stage3_param_persistence_threshold
        persistent = (work.layer_params if work.layer_largest and threshold >= work.layer_largest
                      else _persistent_numel(work, threshold))
        extra = w * (persistent - -(-persistent // hw.total_gpus))
        if extra:
            states["gpu"]["params_persistent"] = extra
    act_gpu, act_host = _activations(work, w)
    gpu_breakdown, gpu_total = _gpu_side(placement, work, hw, w, states["gpu"], act_gpu)
    cpu_breakdown, cpu_total = _host_side(placement, work, hw, w, states["cpu"], act_host)
    g = hw.gpus_per_node
    nvme_breakdown = {"model_states": {k: v * g for k, v in states["nvme"].items()}}
    nvme_total = sum(nvme_breakdown["model_states"].values())

    fits, why = _judge(gpu_total, cpu_total, nvme_total, hw)
    if nvme_total and hw.nvme_free_bytes is None:
        notes.append("NVMe free space unknown: assumed to fit")
    return PresetEstimate(
        name=name,
        placement=placement,
        gpu_bytes_per_gpu=gpu_total,
        cpu_bytes_per_node=cpu_total,
        nvme_bytes=nvme_total,
        activation_bytes_per_gpu=sum(act_gpu.values()),
        model_state_bytes_per_gpu=sum(states["gpu"].values()),
        buffer_bytes_per_gpu=sum(gpu_breakdown["buffers"].values()),
        fits=fits,
        why=why,
        gpu_breakdown=gpu_breakdown,
        cpu_breakdown=cpu_breakdown,
        nvme_breakdown=nvme_breakdown,
        notes=notes,
    )


def largest_micro_batch(placement: Placement, work: Workload, hw: Hardware, limit: int = 4096) -> int:
    """The largest micro batch (at most `limit`) whose estimate fits, all else as in `work`; 0 where
    not even one sequence does. Memory grows with the micro batch, so a bisection finds it."""
    def fits(micro: int) -> bool:
        return estimate_one("largest", placement, replace(work, micro_batch=micro), hw).fits
    if not fits(1):
        return 0
    low, high = 1, 2
    while high <= limit and fits(high):
        low, high = high, high * 2
    high = min(high, limit + 1)
    while high - low > 1:  # fits(low), not fits(high) (or past the limit)
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


# train.activation_checkpointing "auto" turns checkpointing off only where the run without it is estimated
# to need at most this share of each GPU: the offload presets' GPU estimate ran up to 2x low against
# measured peaks (docs/benchmarks.md, "Memory estimate against these measurements").
AUTO_CHECKPOINTING_SHARE = 0.5


def auto_checkpointing(placement: Placement, work: Workload, hw: Hardware) -> tuple[bool, str]:
    """train.activation_checkpointing "auto": (on, why). Off where this estimate of the run without
    checkpointing needs at most AUTO_CHECKPOINTING_SHARE of each GPU's memory (of each rank's share of host
    RAM on a CPU accelerator), on otherwise."""
    without = estimate_one("auto", placement, replace(work, activation_checkpointing=False), hw)
    have = hw.gpu_mem_bytes if hw.accelerator != "cpu" else hw.cpu_mem_bytes // max(1, hw.gpus_per_node)
    where = "GPU" if hw.accelerator != "cpu" else "rank's share of host RAM"
    need = without.gpu_bytes_per_gpu
    if need <= AUTO_CHECKPOINTING_SHARE * have:
        return False, f"off: the run without it is estimated at {_gib(need)} of {_gib(have)} per {where}"
    return True, (f"on: the run without it is estimated at {_gib(need)}, over "
                  f"{AUTO_CHECKPOINTING_SHARE:.0%} of {_gib(have)} per {where}")


def _placement_notes(placement: Placement, hw: Hardware) -> list[str]:
    """What DeepSpeed will not do as the placement asks, or what it buys nothing for, said before the figures."""
    notes = []
    if placement.stage == 3 and placement.offload_param == "none" and hw.total_gpus == 1 and hw.accelerator == "cuda":
        # docs/benchmarks.md, finding 16; dstrain config says the same (config/resolve.py)
        notes.append("one GPU: ZeRO-3 partitions nothing here but still runs its gather machinery; it measured "
                     "0.75-0.98 of plain PyTorch's speed on a 406M GPT (the host's speed decides), 0.95-1.00 on a "
                     "913M and a 1.3B, against stage 2's 0.99-1.03: prefer stage2")
    if placement.offload_param != "none" and placement.stage != 3:
        notes.append(f"offload_param={placement.offload_param} ignored: DeepSpeed offloads parameters in stage 3 only")
    if placement.offload_optimizer == "nvme" and placement.stage != 3:
        notes.append("offload_optimizer=nvme needs stage 3 in DeepSpeed; estimated as if it ran")
    return notes


DEEPSPEED_PERSISTENCE_THRESHOLD = 100_000


def _persistent_numel(work: Workload, threshold: int) -> int:
    """Elements of the (GPT-shaped) model's parameters of at most `threshold` elements each: ZeRO-3
    keeps those whole. Per block: qkv 3d x d, projection d x d, MLP 4d x d twice, two LayerNorms
    (4d); the token and position embeddings; the final LayerNorm."""
    d = work.d_model
    sizes = [(3 * d * d, work.n_layer), (d * d, work.n_layer), (4 * d * d, 2 * work.n_layer),
             (d, 4 * work.n_layer), (work.vocab_size * d, 1), (work.seq_len * d, 1), (d, 2)]
    return min(work.params, sum(numel * count for numel, count in sizes if numel <= threshold))


def _model_states(placement: Placement, P: int, n: int, w: int) -> dict[str, dict[str, int]]:
    """One rank's model states by device, {"gpu": {...}, "cpu": {...}, "nvme": {...}}, for `P`
    parameters of `w` bytes each and a partition of `n` parameters per rank."""
    stage = placement.stage
    opt_dev = placement.offload_optimizer
    param_dev = placement.offload_param if stage == 3 else "none"
    states: dict[str, dict[str, int]] = {"gpu": {}, "cpu": {}, "nvme": {}}
    opt_numel = n if stage >= 1 else P

    # 16-bit (or fp32) parameters.
    if param_dev == "none":
        states["gpu"]["params"] = w * (n if stage == 3 else P)
    elif param_dev == "cpu":
        states["cpu"]["params"] = w * n
    else:
        states["nvme"]["params"] = w * n
        states["cpu"]["params_cached"] = w * min(placement.param_max_in_cpu, n)

    # Low-precision gradients: the whole model below stage 2. With an offloaded optimizer, stage 2
    # streams reduced buckets straight into the host fp32 gradients; stage 3 keeps its 16-bit
    # partition (`grad_partitions_flat_buffer`) on the optimizer's device.
    if stage < 2:
        states["gpu"]["grads"] = w * P
    elif opt_dev == "none":
        states["gpu"]["grads"] = w * n
    elif stage == 3:
        states["cpu"]["grads"] = w * n

    # fp32 gradient partition + fp32 master + Adam moments: the optimizer's working set.
    opt_place = "gpu" if opt_dev == "none" else opt_dev
    grads_fp32_numel = opt_numel
    if stage == 3 and opt_dev == "none":  # built and dropped one sub-group at a time
        grads_fp32_numel = min(placement.sub_group_size, n)
    states[opt_place]["grads_fp32"] = FP32_GRAD_BYTES_PER_PARAM * grads_fp32_numel
    states[opt_place]["optimizer"] = ADAM_FP32_BYTES_PER_PARAM * opt_numel
    if opt_dev == "cpu" and stage < 3:
        # pinned 16-bit buffer: DeepSpeed's copy for the H2D update; dstrain receives the bf16 gradients in it
        states["cpu"]["params_staging"] = w * opt_numel
    return states


def _gpu_buffers(placement: Placement, work: Workload, w: int) -> dict[str, int]:
    """GPU working buffers: stage 3's gathered layers, and the gradient reduce buckets."""
    stage, P, L = placement.stage, work.params, work.largest_layer_params
    buffers: dict[str, int] = {}
    if stage == 3:
        buffers["stage3_largest_layer"] = 2 * w * L
        live = min(P, placement.stage3_max_live_parameters)
        buffers["stage3_live_params"] = w * max(0, live - L)
    if placement.offload_optimizer == "cpu":
        # dstrain's offload steps (dstrain/speedups/offload_chunked_step.py, offload_chunked_step_zero3.py) round to bf16 on
        # the GPU from one chunk of fp32 weights, 32 MiB at the default chunk (at most: a smaller
        # partition needs less); ZeRO-3 with the parameters on the host also stages the bf16 chunk.
        bytes_per_element = 6 if stage == 3 and placement.offload_param == "cpu" else 4
        buffers["offload_step_staging"] = bytes_per_element * min(OFFLOAD_STEP_CHUNK_ELEMENTS, P)
    overlap = placement.overlap_comm if placement.overlap_comm is not None else stage == 3
    if stage >= 1 and placement.contiguous_gradients:
        count = 2 if overlap and stage < 3 else 1
        buffers["reduce_buckets"] = count * w * placement.reduce_bucket_size
    return buffers


def _gradient_sums_bytes(placement: Placement, work: Workload, hw: Hardware, w: int) -> int:
    """dstrain's GPU-side gradient sums with the optimizer offloaded and accumulation (speedups.offload_accumulate):
    one rank's share of the gradients in the model's dtype, ZeRO-2 and 3, CUDA only; 0 where they cannot be."""
    if (work.offload_accumulate is False or work.grad_accum_steps <= 1 or placement.offload_optimizer != "cpu"
            or placement.stage < 2 or hw.accelerator != "cuda"):
        return 0
    return w * -(-work.params // hw.total_gpus)


def _kept_weights_bytes(placement: Placement, work: Workload, hw: Hardware, w: int) -> int:
    """dstrain's weights kept gathered through an accumulation window (speedups.offload_keep_weights): ZeRO-3 with
    the parameters on the CPU, the whole model in the model's dtype on every GPU, beyond the live window
    counted already; CUDA only; 0 where they cannot be."""
    if (work.offload_keep_weights is False or work.grad_accum_steps <= 1 or placement.stage != 3
            or placement.offload_param != "cpu" or hw.accelerator != "cuda"):
        return 0
    return w * (work.params - min(work.params, placement.stage3_max_live_parameters))


def _builds_on_gpu(placement: Placement, hw: Hardware) -> bool:
    # dstrain builds stage 0-2 models on the GPU in fp32 (dstrain.models.build_model) before DeepSpeed
    # casts them: a peak of its own where the steady state keeps less (optimizer offload, many ranks).
    return hw.accelerator == "cuda" and placement.stage != 3


def _gpu_side(placement: Placement, work: Workload, hw: Hardware, w: int, gpu_states: dict[str, int],
              act_gpu: dict[str, int]) -> tuple[dict, int]:
    """(breakdown, peak bytes) per GPU."""
    buffers = _gpu_buffers(placement, work, w)
    runtime_gpu = GPU_RUNTIME_OVERHEAD_BYTES if hw.accelerator == "cuda" else 0

    def made(switch, size: int) -> bool:
        """auto's rule as the ranks apply it, before any activation: the buffer leaves a quarter free."""
        free = hw.gpu_mem_bytes - runtime_gpu - sum(gpu_states.values()) - sum(buffers.values())
        return size > 0 and (switch is True or free - size >= OFFLOAD_SUMS_HEADROOM * hw.gpu_mem_bytes)

    sums = _gradient_sums_bytes(placement, work, hw, w)
    if made(work.offload_accumulate, sums):
        buffers["offload_gradient_sums"] = sums
    kept = _kept_weights_bytes(placement, work, hw, w)
    if made(work.offload_keep_weights, kept):  # after the sums, as the ranks install them
        buffers["offload_kept_weights"] = kept
    breakdown = {
        "model_states": gpu_states,
        "buffers": buffers,
        "activations": act_gpu,
        "runtime": {"cuda_context_nccl": runtime_gpu},
    }
    total = sum(gpu_states.values()) + sum(buffers.values()) + sum(act_gpu.values()) + runtime_gpu
    if _builds_on_gpu(placement, hw):
        build = BUILD_BYTES_PER_PARAM * work.params
        breakdown["model_build"] = {"fp32_model": build}
        total = runtime_gpu + max(build, total - runtime_gpu)
    return breakdown, total


def _host_side(placement: Placement, work: Workload, hw: Hardware, w: int, cpu_states: dict[str, int],
               act_host: dict[str, int]) -> tuple[dict, int]:
    """(breakdown, peak bytes) per node: runtime + max(model build, steady state)."""
    stage, P, L, g = placement.stage, work.params, work.largest_layer_params, hw.gpus_per_node
    n = -(-P // hw.total_gpus)
    host_buffers: dict[str, int] = {}  # host swap buffers for NVMe
    if placement.offload_optimizer == "nvme":
        host_buffers["optimizer_swap"] = placement.optimizer_buffer_count * 4 * min(placement.sub_group_size, n)
    if stage == 3 and placement.offload_param == "nvme":
        host_buffers["param_swap"] = placement.param_buffer_count * placement.param_buffer_size * w
    build_numel = 0 if _builds_on_gpu(placement, hw) else L if (stage == 3 and work.zero_init) else P
    breakdown = {
        "model_states": {k: int(v * g * HOST_BUFFER_FACTOR) for k, v in cpu_states.items()},
        "buffers": {k: v * g for k, v in host_buffers.items()},
        "activations": {k: v * g for k, v in act_host.items()},
        "model_build": {"fp32_model_per_rank": int(BUILD_BYTES_PER_PARAM * build_numel * g * HOST_BUFFER_FACTOR)},
        "runtime": {"rank_processes": HOST_RUNTIME_BYTES_PER_RANK * g},
    }
    steady = sum(sum(breakdown[k].values()) for k in ("model_states", "buffers", "activations"))
    build = sum(breakdown["model_build"].values())
    return breakdown, sum(breakdown["runtime"].values()) + max(build, steady)


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def _judge(gpu: int, cpu: int, nvme: int, hw: Hardware) -> tuple[bool, str]:
    """Does it fit, and why (the failing resources, else the tightest one)."""
    # (label, need, have): with the CPU accelerator the "GPUs" are ranks in host RAM,
    # so both needs come out of the same memory.
    checks: list[tuple[str, int, float]] = []
    if hw.accelerator == "cpu":
        checks.append(("host RAM (ranks + host side)", gpu * hw.gpus_per_node + cpu, hw.cpu_mem_bytes))
    else:
        checks.append((f"GPU ({GPU_HEADROOM:.0%} of {_gib(hw.gpu_mem_bytes)})", gpu, hw.gpu_mem_bytes * GPU_HEADROOM))
        checks.append(("host RAM", cpu, hw.cpu_mem_bytes))
    if nvme and hw.nvme_free_bytes is not None:
        checks.append(("NVMe", nvme, hw.nvme_free_bytes))
    failing = [c for c in checks if c[1] > c[2]]
    if failing:
        return False, "; ".join(f"{label} needs {_gib(need)} > {_gib(have)}" for label, need, have in failing)
    label, need, have = max(checks, key=lambda c: c[1] / c[2])
    return True, f"tightest: {label} {_gib(need)} of {_gib(have)} ({need / have:.0%})"


def estimate_presets(rendered: dict[str, dict], work: Workload, hw: Hardware) -> list[PresetEstimate]:
    """Estimate each {preset name: rendered DeepSpeed config}, keeping the given (fastest-first) order."""
    return [estimate_one(name, placement_from_ds_config(ds), work, hw) for name, ds in rendered.items()]


def recommend(estimates: list[PresetEstimate]) -> tuple[str | None, str]:
    """The first estimate that fits (the list is fastest first), with the reason; None if none fits."""
    if not estimates:
        return None, "no presets to compare"
    for i, est in enumerate(estimates):
        if est.fits:
            reason = f"{est.name} is the fastest preset that fits ({est.why})"
            if i:
                reason += "; faster presets do not: " + "; ".join(f"{e.name}: {e.why}" for e in estimates[:i])
            return est.name, reason
    last = estimates[-1]
    reason = (f"no preset fits; the most frugal, {last.name}: {last.why}. "
              "Use more GPUs or nodes, a smaller micro_batch or seq_len")
    if any(e.activation_bytes_per_gpu > e.model_state_bytes_per_gpu for e in estimates):
        reason += ", or activation checkpointing (activations dominate)"
    return None, reason + "."


# --------------------------------------------------------------------------- hardware and model


def _host_ram_bytes() -> int:
    """MemTotal from /proc/meminfo; the sysconf page count elsewhere."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def detect_hardware() -> Hardware:
    """This node's hardware. nodes is always 1: pass --nodes for a multi-node job.

    With CUDA: every visible GPU, and the smallest one's memory. Without: DeepSpeed's CPU
    accelerator view, one rank per node whose "GPU memory" is host RAM (accelerator="cpu";
    `estimate_one` then checks the ranks' and the host-side bytes together against host RAM).
    """
    import torch

    host = _host_ram_bytes()
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        count = torch.cuda.device_count()
        mem = min(torch.cuda.get_device_properties(i).total_memory for i in range(count))
        return Hardware(gpus_per_node=count, nodes=1, gpu_mem_bytes=mem, cpu_mem_bytes=host)
    return Hardware(gpus_per_node=1, nodes=1, gpu_mem_bytes=host, cpu_mem_bytes=host, accelerator="cpu")


# --------------------------------------------------------------------------- output


def to_json(estimates: list[PresetEstimate], recommended: str | None, reason: str, hw: Hardware,
            work: Workload) -> dict:
    """A JSON-serialisable report: presets, recommendation, hardware, workload, assumptions."""
    presets = []
    for e in estimates:
        presets.append({
            "name": e.name,
            "gpu_bytes_per_gpu": e.gpu_bytes_per_gpu,
            "cpu_bytes_per_node": e.cpu_bytes_per_node,
            "nvme_bytes": e.nvme_bytes,
            "fits": e.fits,
            "why": e.why,
            "recommended": e.name == recommended,
            "model_state_bytes_per_gpu": e.model_state_bytes_per_gpu,
            "buffer_bytes_per_gpu": e.buffer_bytes_per_gpu,
            "activation_bytes_per_gpu": e.activation_bytes_per_gpu,
            "placement": asdict(e.placement),
            "gpu_breakdown": e.gpu_breakdown,
            "cpu_breakdown": e.cpu_breakdown,
            "nvme_breakdown": e.nvme_breakdown,
            "notes": list(e.notes),
        })
    return {
        "presets": presets,
        "recommended": recommended,
        "reason": reason,
        "hardware": asdict(hw),
        "workload": {**asdict(work), "active_params": work.active_params},
        "assumptions": {
            "gpu_headroom": GPU_HEADROOM,
            "gpu_runtime_overhead_bytes": GPU_RUNTIME_OVERHEAD_BYTES,
            "host_runtime_bytes_per_rank": HOST_RUNTIME_BYTES_PER_RANK,
            "host_buffer_factor": HOST_BUFFER_FACTOR,
            "attention": "flash/SDPA (no s^2 scores stored)" if work.flash_attention else "eager (s^2 scores stored)",
        },
    }


def render(estimates: list[PresetEstimate], recommended: str | None, reason: str, hw: Hardware,
           work: Workload, console) -> None:
    """Print the estimate as a rich table (GiB, 1 decimal) with the recommendation below it."""
    from rich.table import Table

    from dstrain.console_text import outside  # notes and reasons may quote config values

    def gib(n: int) -> str:
        return f"{n / GiB:.1f}"

    kind = "GPU" if hw.accelerator == "cuda" else "CPU rank"
    active = f", {work.active_params / 1e9:.2f}B active per token (mixture of experts)" if work.inactive_params else ""
    console.print(
        f"{work.params / 1e9:.2f}B params{active} (largest layer {work.largest_layer_params / 1e6:.0f}M), "
        f"{work.precision}, micro_batch {work.micro_batch} x seq_len {work.seq_len}"
        f"{f' over {work.sequence_parallel} sequence-parallel ranks' if work.sequence_parallel > 1 else ''}, "
        f"activation checkpointing {'on' if work.activation_checkpointing else 'off'}"
        f"{' (to CPU)' if work.activation_checkpointing and work.cpu_checkpointing else ''}"
        f"{', tiled MLP' if work.tiled_mlp else ''}")
    console.print(
        f"{hw.nodes} node(s) x {hw.gpus_per_node} {kind}(s) x {gib(hw.gpu_mem_bytes)} GiB, "
        f"host RAM {gib(hw.cpu_mem_bytes)} GiB per node; a GPU may use {GPU_HEADROOM:.0%}")
    table = Table(title="Memory per preset (GiB)")
    table.add_column("preset")
    table.add_column("ZeRO")
    table.add_column("offload opt/param")
    for header in ("GPU / GPU", "states", "buffers", "activations", "host / node", "NVMe / node"):
        table.add_column(header, justify="right")
    table.add_column("fits", justify="center")
    for e in estimates:
        p = e.placement
        table.add_row(
            outside(e.name), str(p.stage), f"{p.offload_optimizer}/{p.offload_param}",
            gib(e.gpu_bytes_per_gpu), gib(e.model_state_bytes_per_gpu), gib(e.buffer_bytes_per_gpu),
            gib(e.activation_bytes_per_gpu), gib(e.cpu_bytes_per_node), gib(e.nvme_bytes),
            "[green]✓[/green]" if e.fits else "[red]✗[/red]",
            style="bold green" if e.name == recommended else None,
        )
    console.print(table)
    for e in estimates:
        for note in e.notes:
            console.print(f"[dim]{outside(e.name)}: {outside(note)}[/dim]")
    if recommended:
        console.print(f"[bold green]recommended: {outside(recommended)}[/bold green] — {outside(reason)}")
    else:
        console.print(f"[bold red]nothing fits[/bold red] — {outside(reason)}")
