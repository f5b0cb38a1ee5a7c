"""ZeRO-3 with the optimizer on the CPU: the optimizer step in chunks (registry: offload_chunks_zero3,
offload_host_rounding).

As offload_chunked_step.py does for ZeRO-1/2: unscale and Adam a chunk at a time while it is in cache,
then the chunk's fp32 weights go to the GPU, are rounded to bf16 there and go back to the host partition
(or straight into the GPU partition without parameter offload). With parameter offload, dstrain's Adam
op can instead round the new weights into the host's bf16 partition in the Adam pass itself. The fp32
masters are pinned once where their copies go to the GPU. The step waits for its last copy, so the next
fetch reads finished weights. Bit-identical to DeepSpeed's step (tests/test_offload_step_zero3.py); the
rest of the step is DeepSpeed's own code, in its order.
"""

from __future__ import annotations

import types

from dstrain.speedups.offload_chunked_step import SIMD_BLOCK, adam_chunk_update, record_copies, unscale_factor


def applies(engine) -> str | None:
    """Why the chunked step does not cover `engine` (None: it does): it needs ZeRO-3 with the optimizer
    offloaded to the CPU as DeepSpeedCPUAdam with fp32 masters, without NVMe swapping, partial offload
    (`ratio`), SuperOffload, ZenFlow, Muon or torch autocast's grad scaler, on a DeepSpeed with the
    pieces it calls."""
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    optimizer = getattr(engine, "optimizer", None)
    if type(optimizer) is not DeepSpeedZeroOptimizer_Stage3:  # SuperOffload's subclass has its own step
        return "not ZeRO-3's own optimizer"
    if not getattr(optimizer, "offload_optimizer", False):
        return "no ZeRO-3 CPU offload"
    needed = ("fp32_partitioned_groups_flat", "fp16_partitioned_groups_flat", "fp16_groups", "subgroup_to_device",
              "sub_group_to_group_id", "_pre_step", "_partition_all_parameters", "_get_norm_groups",
              "_overflow_check_and_loss_scale_update", "_loss_scale_update_and_overflow_cleanup",
              "_prepare_sub_group", "_unflatten_partitioned_parameters", "_release_sub_group", "_post_step",
              "_apply_muon_to_accumulated_grads", "n_caching_allocator_flushes")
    missing = [name for name in needed if not hasattr(optimizer, name)]
    if missing:
        return f"this DeepSpeed's stage-3 optimizer lacks {', '.join(missing)}"
    for flag, what in (("swap_optimizer", "NVMe swapping"), ("zenflow", "ZenFlow"), ("use_muon", "Muon")):
        if getattr(optimizer, flag, False):
            return what
    if getattr(optimizer, "torch_autocast_gradscaler", None) is not None:
        return "torch autocast's grad scaler"
    if type(optimizer.optimizer) is not DeepSpeedCPUAdam:
        return f"the CPU optimizer is {type(optimizer.optimizer).__name__}, not DeepSpeedCPUAdam"
    if any(device != "cpu" for device in optimizer.subgroup_to_device.values()):
        return "partial offload (some sub-groups on the accelerator)"
    if any(flat is None for flat in optimizer.fp16_partitioned_groups_flat):
        return "a sub-group without its flat bf16 partition"
    if any(m.dtype != torch.float32 or m.device.type != "cpu" for m in optimizer.fp32_partitioned_groups_flat):
        return "the master weights are not fp32 on the host"
    return None


def install(engine, state, chunk_elements: int, round_op=None) -> None:
    """Give `engine`'s ZeRO-3 CPU-offload optimizer the chunked step. `round_op`: dstrain's Adam op, to
    round the new weights into the host's bf16 partition in the Adam pass itself (see rounds_on_host)."""
    from deepspeed.accelerator import get_accelerator

    optimizer = engine.optimizer
    state.round_op = round_op
    if get_accelerator().device_name() != "cpu" and round_op is None:
        for master in optimizer.fp32_partitioned_groups_flat:  # pinned once: their copies to the GPU must not block
            if not master.is_pinned():
                master.data = get_accelerator().pin_memory(master.data)
    state.chunk = max(SIMD_BLOCK, chunk_elements // SIMD_BLOCK * SIMD_BLOCK)
    state.staging = None  # (fp32, bf16) chunks on the accelerator, made on first use
    optimizer.step = types.MethodType(_chunked_step, optimizer)


def rounds_on_host(engine) -> str | None:
    """Why the new weights cannot be rounded into the host's bf16 partition in the Adam pass (None: they
    can): that needs parameter offload, every bf16 partition on the host."""
    import torch

    flats = engine.optimizer.fp16_partitioned_groups_flat
    if any(flat.dtype != torch.bfloat16 for flat in flats):
        return "the weights are not bf16"
    if any(flat.device.type != "cpu" for flat in flats):
        return "the bf16 partitions are not on the host (no parameter offload)"
    return None


def _chunked_step(self, closure=None):
    """DeepSpeedZeroOptimizer_Stage3.step for CPU offload, with each sub-group updated in chunks."""
    from deepspeed.runtime.zero import stage3 as zero3

    factor = begin_step(self)
    if factor is None:
        return
    timer_names = {zero3.OPTIMIZER_STEP_TIMER}
    self.timers(zero3.OPTIMIZER_STEP_TIMER).start()
    for sub_group_id in range(len(self.fp16_groups)):
        self._prepare_sub_group(sub_group_id, timer_names)
        _update_sub_group(self, sub_group_id, factor)
        self._unflatten_partitioned_parameters(sub_group_id)
        self._release_sub_group(sub_group_id, timer_names)
    copies = record_copies(self.dstrain_speedups.staging[0]) if self.dstrain_speedups.staging is not None else None
    if copies is not None:  # the next forward fetches these weights: they must have landed
        copies.synchronize()
    self.timers(zero3.OPTIMIZER_STEP_TIMER).stop()
    self._post_step(timer_names)
    warn_on_allocator_flushes(self)


def begin_step(self) -> float | None:
    """What DeepSpeed's step does before the sub-groups (checked_global_norm, with DeepSpeed's release
    and norm). The factor to unscale and clip the gradients by; None for a skipped step."""
    scaled_global_grad_norm = checked_global_norm(self, self._partition_all_parameters, self._get_norm_groups)
    return None if scaled_global_grad_norm is None else unscale_factor(self, scaled_global_grad_norm)


def checked_global_norm(self, release_all, norm_groups):
    """What DeepSpeed's stage-3 step does before the sub-groups: release every parameter
    (`release_all()`), check for overflow, take the global norm from `norm_groups()` and record it. The
    norm, still loss-scaled; None for a skipped step (overflow or a non-finite norm), which DeepSpeed's
    cleanup has already handled."""
    from deepspeed.runtime.zero import stage3 as zero3

    self._pre_step()
    release_all()
    self._overflow_check_and_loss_scale_update(update_scale=False)
    scaled_global_grad_norm = None
    if not self.overflow:
        self._apply_muon_to_accumulated_grads()  # DeepSpeed's order; returns at once (never installed with Muon)
        scaled_global_grad_norm = zero3.combine_grad_norm_groups(norm_groups())
        if zero3.is_invalid_grad_norm(scaled_global_grad_norm):
            self.overflow = True
    if self._loss_scale_update_and_overflow_cleanup():  # a skipped step, as DeepSpeed skips it
        return None
    self._global_grad_norm = scaled_global_grad_norm / self.loss_scale
    return scaled_global_grad_norm


def warn_on_allocator_flushes(self) -> None:
    """DeepSpeed's warning at the end of its step, kept."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero import stage3 as zero3

    retries = get_accelerator().memory_stats().get("num_alloc_retries") or 0
    if retries > self.n_caching_allocator_flushes:
        if zero3.dist.get_rank() == 0:
            zero3.logger.warning("%d pytorch allocator cache flushes since last step: high memory pressure, "
                                 "slow; reduce memory use", retries - self.n_caching_allocator_flushes)
        self.n_caching_allocator_flushes = retries


def _update_sub_group(self, sub_group_id: int, factor: float) -> None:
    update_chunk = chunk_updater(self, sub_group_id, factor)
    size = self.fp32_partitioned_groups_flat[sub_group_id].numel()
    for start in range(0, size, self.dstrain_speedups.chunk):
        update_chunk(start, min(start + self.dstrain_speedups.chunk, size))


def chunk_updater(self, sub_group_id: int, factor: float, adam_op=None):
    """update_chunk(start, end): unscale, Adam, and the rounding to bf16 into the sub-group's bf16
    partition, for one chunk (what unscale_and_clip_grads, DeepSpeedCPUAdam.step and the copy after it
    do). The Adam step is counted, and its rate read, when this is called. Copies to the accelerator go
    on the current stream of the thread that calls update_chunk; chunks must start on SIMD_BLOCK.
    `adam_op`: the Adam kernel's op, if not DeepSpeed's binding (see adam_chunk_update)."""
    import torch
    from deepspeed.accelerator import get_accelerator

    adam = self.optimizer
    group = adam.param_groups[self.sub_group_to_group_id[sub_group_id]]
    master = self.fp32_partitioned_groups_flat[sub_group_id]
    bit16 = self.fp16_partitioned_groups_flat[sub_group_id]
    on_host = bit16.device.type == "cpu"
    round_op = self.dstrain_speedups.round_op  # set only where every bf16 partition is on the host
    rounded = bit16.data if round_op is not None else None
    round_on_device = round_op is None and master.is_pinned() and (not on_host or bit16.is_pinned())
    bf16_grads = self.dstrain_speedups.bf16_grads
    if bf16_grads is not None and self.dstrain_speedups.grads_in_bf16:  # this step's gradients came in bf16
        op, views = bf16_grads
        update = adam_chunk_update(adam, group, master, factor, op=adam_op or op, bf16_grads=views[sub_group_id],
                                   rounded=rounded)
    else:
        update = adam_chunk_update(adam, group, master, factor, adam_op or round_op, rounded=rounded)
    weights, chunk = master.data, self.dstrain_speedups.chunk
    if update is not None and rounded is not None:  # the Adam pass writes the bf16 weights itself
        return update
    if round_on_device:
        device = bit16.device if not on_host else torch.device(get_accelerator().current_device_name())
        if self.dstrain_speedups.staging is None or self.dstrain_speedups.staging[0].device != device:
            self.dstrain_speedups.staging = (torch.empty(chunk, dtype=weights.dtype, device=device),
                                     torch.empty(chunk, dtype=bit16.dtype, device=device) if on_host else None)
    staging = self.dstrain_speedups.staging

    def update_chunk(start: int, end: int) -> None:
        if update is not None:
            update(start, end)
        if not round_on_device:
            bit16.data[start:end].copy_(weights[start:end])
            return
        # One stream: each staging chunk is read before the next chunk's copy overwrites it.
        fp32_staging = staging[0][:end - start]
        fp32_staging.copy_(weights[start:end], non_blocking=True)
        if on_host:
            bit16_staging = staging[1][:end - start]
            bit16_staging.copy_(fp32_staging)
            bit16.data[start:end].copy_(bit16_staging, non_blocking=True)
        else:
            bit16.data[start:end].copy_(fp32_staging)
    return update_chunk
