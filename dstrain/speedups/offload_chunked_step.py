"""ZeRO-1/2 with the optimizer on the CPU: the optimizer step in cache-sized chunks, and the gradients sent
to the host in bf16 (registry: offload_chunks, offload_bf16_grads).

DeepSpeed's offload step makes three host passes over the fp32 partition (unscale, Adam, rounding to
bf16) before the whole bf16 partition goes to the GPU. Here the work goes a chunk at a time: unscale and
Adam while the chunk is in cache, then its fp32 weights go to the GPU (pinned, asynchronous), which
rounds them, so the copies run beside the next chunks' updates (on a CPU accelerator the rounding stays
on the host, chunk by chunk). With bf16 weights the gradients reach the host as they are, into
DeepSpeed's pinned bf16 buffer, and dstrain's Adam op widens them in cache (cpu_adam_nogil.cpp).
Bit-identical to DeepSpeed's step: the same unscale factor, the same Adam kernel on chunks that start on
its SIMD blocks, the same rounding (tests/test_offload_syncs.py). The rest is DeepSpeed's code path.
"""

from __future__ import annotations

import types

# 8M elements: the fastest of 0.5M to 32M on the H100 host (benchmarks/offload_step_parts.py, removed after 05c256e; training
# rows at 8M, 16M and 32M were within noise of each other). The GPU staging buffer is one chunk, 32 MiB.
DEFAULT_CHUNK_ELEMENTS = 1 << 23
SIMD_BLOCK = 1024  # a multiple of DeepSpeed's widest vector step (16 floats x 8): chunk starts align to it
# bf16 gradients are widened this many at a time per thread: 128 KiB of fp32, well inside a core's L2.
BF16_GRAD_TILE = 1 << 15


def applies(engine) -> str | None:
    """Why the chunked step does not cover `engine` (None: it does): it needs a ZeRO-1/2 CPU-offload
    optimizer with DeepSpeedCPUAdam and fp32 masters, without ZenFlow or torch autocast's grad scaler,
    on a DeepSpeed with the pieces it calls."""
    optimizer = getattr(engine, "optimizer", None)
    if not getattr(optimizer, "cpu_offload", False):
        return "no ZeRO-1/2 CPU offload"
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    needed = ("single_partition_of_fp32_groups", "param_buffer_of_bit16_for_cpu_offload_groups",
              "parallel_partitioned_bit16_groups", "bit16_groups_flat", "real_dp_process_group",
              "_wait_for_offload_copies", "scaled_global_norm", "_update_scale", "reset_cpu_buffers",
              "_release_preflattened_grad_buffers", "_lazy_init_hp_params_optimizer_state",
              "_update_model_bit16_weights", "nccl_start_alignment_factor", "allgather_bucket_size")
    missing = [name for name in needed if not hasattr(optimizer, name)]
    if missing:
        return f"this DeepSpeed's ZeRO-1/2 optimizer lacks {', '.join(missing)}"
    if type(optimizer.optimizer) is not DeepSpeedCPUAdam:
        return f"the CPU optimizer is {type(optimizer.optimizer).__name__}, not DeepSpeedCPUAdam"
    if getattr(optimizer, "zenflow", False):
        return "ZenFlow"
    if getattr(optimizer, "torch_autocast_gradscaler", None) is not None:
        return "torch autocast's grad scaler"
    if any(p.dtype.is_floating_point and p.element_size() != 4 for p in optimizer.single_partition_of_fp32_groups):
        return "the master weights are not fp32"
    return None


def install(engine, state, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> None:
    """Give `engine`'s ZeRO-1/2 CPU-offload optimizer the chunked step."""
    optimizer = engine.optimizer
    state.chunk = max(SIMD_BLOCK, chunk_elements // SIMD_BLOCK * SIMD_BLOCK)
    state.copies_done = None
    state.bf16_grads = None  # (op, tile) once the bf16 gradients apply
    state.staging = None  # one chunk of fp32 weights on the accelerator, made on first use
    optimizer.step = types.MethodType(_chunked_step, optimizer)


def bf16_grads_apply(engine) -> str | None:
    """Why `engine`'s gradients cannot reach the host in bf16 (None: they can): they need bf16 weights,
    no fp32 gradient accumulation (DeepSpeed's compact partition buffer) and no low-precision master
    weights. Once installed, DeepSpeed's fp32 gradient partition is no longer written: `safe_get_full_grad`
    between backward and step would read stale values there (dstrain's loop never calls it)."""
    import torch

    optimizer = getattr(engine, "optimizer", None)
    needed = ("bit16_groups", "single_partition_of_fp32_groups", "param_buffer_of_bit16_for_cpu_offload_groups",
              "grad_position", "get_param_gradient_attribute", "_record_gradient_stream", "_record_offload_copy",
              "clear_grad_attribute", "_pending_offload_events", "_offload_gradient_safety_enabled",
              "async_inplace_copy_grad_to_fp32_buffer_from_gpu", "_use_compact_grad_partition_buffer")
    if not getattr(optimizer, "cpu_offload", False):
        return "no ZeRO-1/2 CPU offload"
    missing = [name for name in needed if not hasattr(optimizer, name)]
    if missing:
        return f"this DeepSpeed's ZeRO-1/2 optimizer lacks {', '.join(missing)}"
    if getattr(optimizer, "low_precision_master_weights_and_grads", False):
        return "low-precision master weights"
    groups = len(optimizer.bit16_groups)
    buffers = optimizer.param_buffer_of_bit16_for_cpu_offload_groups
    if len(buffers) != groups or any(optimizer._use_compact_grad_partition_buffer(i) for i in range(groups)):
        return "fp32 gradient accumulation (DeepSpeed's compact gradient buffer)"
    for i in range(groups):
        master = optimizer.single_partition_of_fp32_groups[i]
        if (buffers[i].dtype != torch.bfloat16 or buffers[i].numel() != master.numel()
                or any(p.dtype != torch.bfloat16 for p in optimizer.bit16_groups[i])):
            return "the weights are not bf16"
    return None


def install_bf16_grads(engine, state, tile: int = BF16_GRAD_TILE) -> None:
    """Send `engine`'s gradients to the host in bf16 and update from them (the chunked step, then the only
    reader of the host gradients, and dstrain's Adam op in state.adam_op are installed already)."""
    optimizer = engine.optimizer
    state.bf16_grads = (state.adam_op, tile)
    optimizer.async_inplace_copy_grad_to_fp32_buffer_from_gpu = types.MethodType(_copy_grad_in_bf16, optimizer)


def _copy_grad_in_bf16(self, param):
    """DeepSpeed's async_inplace_copy_grad_to_fp32_buffer_from_gpu with the gradient sent as it is, into
    the pinned bf16 buffer: the same offsets, stream waits and copy records."""
    from deepspeed.accelerator import get_accelerator
    import torch

    group, source_offset, dest_offset, num_elements = self.grad_position[self.get_param_id(param)]
    buffer = self.param_buffer_of_bit16_for_cpu_offload_groups[group]
    destination = buffer.view(-1).narrow(0, dest_offset, num_elements)
    grad_accum = self.get_param_gradient_attribute(param)
    assert grad_accum is not None
    source = grad_accum.view(-1).narrow(0, source_offset, num_elements)
    assert source.dtype == torch.bfloat16, "bf16 gradients only"
    stream = get_accelerator().current_stream()
    if self._offload_gradient_safety_enabled:  # successive backwards may write the buffer from other streams
        for producer, event in self._pending_offload_events.items():
            if producer != stream:
                stream.wait_event(event)
    destination.copy_(source, non_blocking=True)
    self._record_gradient_stream(grad_accum, stream)
    self._record_offload_copy()
    self.clear_grad_attribute(param)


def unscale_factor(optimizer, total_norm) -> float:
    """The factor DeepSpeed's unscale_and_clip_grads multiplies the gradients by (1 / (loss scale x clip)),
    as the float32 it computes; 1.0 where it would not touch them."""
    import torch
    from deepspeed.runtime.utils import is_invalid_grad_norm

    if optimizer.clip_grad == 0.0 and optimizer.loss_scale == 1.0:
        return 1.0
    combined_scale = optimizer.loss_scale
    if optimizer.clip_grad > 0.:
        clip_norm = total_norm
        if is_invalid_grad_norm(clip_norm):  # step() refuses these; a direct caller gets no clip
            clip_norm = torch.tensor(float("inf"), dtype=torch.float, device=optimizer.device)
        clip = ((clip_norm / optimizer.loss_scale) + 1e-6) / optimizer.clip_grad
        combined_scale = torch.clamp(clip, min=1.0) * optimizer.loss_scale
    return float(1. / combined_scale)


def _chunked_step(self, closure=None):
    """DeepSpeedZeroOptimizer.step for CPU offload, with the update of each partition done in chunks."""
    import torch
    from deepspeed.runtime.utils import is_invalid_grad_norm
    from deepspeed.runtime.zero import stage_1_and_2 as zero

    self.micro_step_id = zero.INITIAL_MICRO_STEP_ID
    self._wait_for_offload_copies()
    self._offload_accumulated_param_ids = set()
    if not self.compute_grad_norm:
        self._global_grad_norm = None

    self.overflow = False
    if self.check_grad_overflow:
        self.check_overflow(partition_gradients=self.partition_gradients)
    scaled_global_grad_norm = None
    if self.compute_grad_norm and not self.overflow:
        scaled_global_grad_norm = self.scaled_global_norm()
        if (self.dtype != torch.bfloat16 or self.check_grad_overflow) and is_invalid_grad_norm(scaled_global_grad_norm):
            self.overflow = True

    prev_scale = self.loss_scale
    self._update_scale(self.overflow)
    if self.overflow:  # a skipped step, as DeepSpeed skips it
        if self.compute_grad_norm:
            self._global_grad_norm = float("inf")
        self.zero_grad(set_to_none=True)
        self._release_preflattened_grad_buffers()
        self.reset_cpu_buffers()
        for timer in zero.OPTIMIZER_TIMERS:
            self.timers(timer).start()
            self.timers(timer).stop()
        return

    if scaled_global_grad_norm is not None:
        self._global_grad_norm = scaled_global_grad_norm / prev_scale
    factor = unscale_factor(self, scaled_global_grad_norm)
    if self.dstrain_speedups.copies_done is not None:  # last step's copies must have read the weights Adam writes
        self.dstrain_speedups.copies_done.synchronize()

    for i in range(len(self.bit16_groups)):
        self.timers(zero.OPTIMIZER_STEP_TIMER).start()
        partition_id = zero.dist.get_rank(group=self.real_dp_process_group[i])
        _update_partition(self, i, partition_id, factor)
        self._lazy_init_hp_params_optimizer_state()
        self._release_preflattened_grad_buffers(i)
        self.averaged_gradients[i] = None
        self.timers(zero.OPTIMIZER_STEP_TIMER).stop()
    self.dstrain_speedups.copies_done = record_copies(self.parallel_partitioned_bit16_groups[0][0])
    self.reset_cpu_buffers()

    self.timers(zero.OPTIMIZER_ALLGATHER_TIMER).start()
    zero.all_gather_dp_groups(groups_flat=self.bit16_groups_flat,
                              partitioned_param_groups=self.parallel_partitioned_bit16_groups,
                              dp_process_group=self.real_dp_process_group,
                              start_alignment_factor=self.nccl_start_alignment_factor,
                              allgather_bucket_size=self.allgather_bucket_size)
    self.timers(zero.OPTIMIZER_ALLGATHER_TIMER).stop()
    for i in range(len(self.bit16_groups)):
        self._update_model_bit16_weights(i)
    self.timers.log(zero.OPTIMIZER_TIMERS)


def _update_partition(self, group_index: int, partition_id: int, factor: float) -> None:
    """Unscale, Adam, round to bf16 and put on the accelerator, one chunk of this rank's partition at a
    time: what DeepSpeedCPUAdam.step and the copies after it do, per chunk."""
    import torch

    adam = self.optimizer
    group = adam.param_groups[group_index]
    master = self.single_partition_of_fp32_groups[group_index]  # the CPU Adam's parameter
    device_bit16 = self.parallel_partitioned_bit16_groups[group_index][partition_id]
    round_on_device = device_bit16.device.type != "cpu" and master.is_pinned()  # pageable: DeepSpeed's way
    bf16_grads = self.dstrain_speedups.bf16_grads
    if bf16_grads is not None:  # read before the rounding below overwrites each chunk of the buffer
        op, tile = bf16_grads
        update = adam_chunk_update(adam, group, master, factor, op=op,
                                   bf16_grads=self.param_buffer_of_bit16_for_cpu_offload_groups[group_index], tile=tile)
    else:
        update = adam_chunk_update(adam, group, master, factor)
    weights = master.data
    state = self.dstrain_speedups
    chunk = state.chunk
    if round_on_device and (state.staging is None or state.staging.device != device_bit16.device):
        state.staging = torch.empty(chunk, dtype=weights.dtype, device=device_bit16.device)
    for start in range(0, weights.numel(), chunk):
        end = min(start + chunk, weights.numel())
        if update is not None:
            update(start, end)
        if round_on_device:  # stream order keeps the staging chunk until the rounding has read it
            staging = state.staging[:end - start]
            staging.copy_(weights[start:end], non_blocking=True)
            device_bit16.data[start:end].copy_(staging)
        else:
            host_bit16 = self.param_buffer_of_bit16_for_cpu_offload_groups[group_index]
            host_bit16.data[start:end].copy_(weights[start:end])
            device_bit16.data[start:end].copy_(host_bit16.data[start:end], non_blocking=True)


def adam_chunk_update(adam, group: dict, master, factor: float, op=None, bf16_grads=None, tile: int = BF16_GRAD_TILE,
                      rounded=None):
    """DeepSpeedCPUAdam.step for one fp32 partition, cut by chunk: it counts the step (initialising the
    moments on the first, as DeepSpeedCPUAdam does) and returns update(start, end), which unscales that
    chunk of the gradient by `factor` and runs DeepSpeed's Adam kernel on it (through `op`, an op with
    the same adam_update and the optimizer registered under adam.opt_id, or adam's own); None without a
    gradient. With `bf16_grads` (and dstrain's op) the gradient is read from there, widened and unscaled
    in tiles of `tile`. With `rounded` (a bf16 host tensor the size of `master`; needs dstrain's op) each
    chunk's new weights are also rounded into it, tile by tile, in the same pass. Chunks must start on
    SIMD_BLOCK boundaries for the values to be DeepSpeed's."""
    import torch

    grad = master.grad
    if grad is None:
        return None
    state = adam.state[master]
    if len(state) == 0:  # DeepSpeedCPUAdam's first-step initialisation
        state["step"] = 0
        state_dtype = torch.float if adam.fp32_optimizer_states else master.dtype
        state["exp_avg"] = torch.zeros_like(master.data, dtype=state_dtype, device="cpu")
        state["exp_avg_sq"] = torch.zeros_like(master.data, dtype=state_dtype, device="cpu")
    state["step"] += 1
    # Read now: an overlapped step (offload_overlap_zero3.py) runs the chunks after the scheduler has
    # already set the next step's rate.
    step, lr, (beta1, beta2), eps = state["step"], group["lr"], group["betas"], group["eps"]
    decay, bias_correction = group["weight_decay"], group["bias_correction"]
    weights, exp_avg, exp_avg_sq = master.data, state["exp_avg"], state["exp_avg_sq"]
    adam_update = (op or adam.ds_opt_adam).adam_update

    if bf16_grads is not None or rounded is not None:  # dstrain's op: tiles widened (bf16) and/or rounded
        grads = bf16_grads if bf16_grads is not None else grad.data

        def update_tiles(start: int, end: int) -> None:
            op.adam_update_tiles(adam.opt_id, step, lr, beta1, beta2, eps, decay, bias_correction,
                                 weights[start:end], grads[start:end], exp_avg[start:end], exp_avg_sq[start:end],
                                 factor, tile, None if rounded is None else rounded[start:end])
        return update_tiles

    def update(start: int, end: int) -> None:
        grad_chunk = grad.data[start:end]
        if factor != 1.0:
            grad_chunk.mul_(factor)
        adam_update(adam.opt_id, step, lr, beta1, beta2, eps, decay, bias_correction, weights[start:end], grad_chunk,
                    exp_avg[start:end], exp_avg_sq[start:end])
    return update


def record_copies(device_tensor):
    """An event after the copies just queued to the accelerator; None where copies are synchronous (CPU)."""
    if device_tensor.device.type == "cpu":
        return None
    from deepspeed.accelerator import get_accelerator

    event = get_accelerator().Event()
    event.record()
    return event
