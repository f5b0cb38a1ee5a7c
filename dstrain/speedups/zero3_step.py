"""ZeRO-3 without offload: DeepSpeed's stage-3 step with its per-parameter host work batched (registry:
zero3_step, zero3_gather).

Around its update DeepSpeed's step walks the parameters one at a time in Python: it releases each, takes
the gradient norm a gradient at a time, and gathers the persistent parameters one collective each. Here
the release frees each parameter's data directly, the norm is one multi-tensor norm per sub-group, and
the gather is one all-gather regrouped by one copy. The rest is DeepSpeed's own code, in its order.

Memory: before each sub-group's update DeepSpeed flattens its gradient partitions into a new tensor (a
copy of up to sub_group_size elements, 1e9 by default) and, in a bf16 run, converts that copy to fp32 (a
second one): both exist beside every other state, and on one H200 a 1.24B model's DPO step peaked there.
The partitions already lie end to end in DeepSpeed's gradient buffer (contiguous gradients), so here the
update reads that span of the buffer, converted to fp32 where the buffer is bf16: the same values, one copy
fewer (2 bytes an element in bf16, all 4 in fp32).
The norm is summed in another order (its last bits may differ, and so a clip factor); without clipping
the weights are DeepSpeed's to the bit (tests/test_zero3_step.py).
"""

from __future__ import annotations

import types


def applies(engine) -> str | None:
    """Why `engine` is not a set-up the batched step covers (None: it is): ZeRO-3 on the accelerator without
    CPU or NVMe offload, Muon, ZenFlow, torch autocast's grad scaler, model or expert parallelism, hpZ's
    secondary partitions, quantized weights or DeepCompile (whose graph gathers and releases the
    parameters itself), on a DeepSpeed with the pieces it calls."""
    import torch
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
    from deepspeed.runtime.zero.partitioned_param_coordinator import iter_params
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    optimizer = getattr(engine, "optimizer", None)
    if type(optimizer) is not DeepSpeedZeroOptimizer_Stage3:
        return "not ZeRO-3"
    is_deepcompile = getattr(engine, "is_deepcompile_enabled", None)
    if is_deepcompile is None or is_deepcompile():
        return "DeepCompile gathers and releases the parameters itself"
    needed = ("_pre_step", "_overflow_check_and_loss_scale_update", "_apply_muon_to_accumulated_grads",
              "_loss_scale_update_and_overflow_cleanup",
              "_prepare_sub_group", "unscale_and_clip_grads", "_optimizer_step",
              "_reassign_or_swap_out_partitioned_parameters", "_release_sub_group", "invalidate_secondary_tensor",
              "_get_param_partition_group", "_autoep_expert_parallel_group", "averaged_gradients", "fp16_groups",
              "persistent_parameters", "parameter_offload", "model_parallel_group", "timers",
              "n_caching_allocator_flushes")
    missing = [name for name in needed if not hasattr(optimizer, name)]
    if missing or not hasattr(torch, "_foreach_norm"):
        return f"this DeepSpeed's stage-3 optimizer lacks {', '.join(missing) or 'torch._foreach_norm'}"
    if getattr(optimizer, "offload_optimizer", False) or getattr(optimizer, "offload_param", False):
        return "CPU offload (the offload_* changes cover it)"
    for flag, what in (("swap_optimizer", "NVMe swapping"), ("zenflow", "ZenFlow"), ("use_muon", "Muon")):
        if getattr(optimizer, flag, False):
            return what
    if optimizer.model_parallel_group is not None:
        return "model parallelism"
    if getattr(optimizer, "zero_hpz_partition_size", 1) > 1:
        return "hpZ's secondary partitions"
    if getattr(optimizer, "torch_autocast_gradscaler", None) is not None:
        return "torch autocast's grad scaler"
    coordinator = optimizer.parameter_offload.get_param_coordinator()
    if not hasattr(coordinator, "_PartitionedParameterCoordinator__inflight_param_registry"):
        return "this DeepSpeed's parameter coordinator lacks its in-flight registry"
    for param in iter_params(optimizer.parameter_offload.module, recurse=True):
        partition = getattr(param, "ds_tensor", None)
        if partition is None or getattr(param, "ds_secondary_tensor", None) is not None:
            return "a parameter without its partition, or with a secondary one"
        if hasattr(partition, "ds_quant_scale"):
            return "quantized weights"
        if getattr(partition, "final_location", None) == OffloadDeviceEnum.nvme:
            return "parameters on NVMe"
    if any(group and optimizer._autoep_expert_parallel_group(group) is not None for group in optimizer.fp16_groups):
        return "expert parallelism"
    return None


def install(engine, state) -> None:
    """Give `engine`'s ZeRO-3 optimizer the batched release, norm and gather (applies() said it covers it)."""
    import torch
    from deepspeed import comm as dist
    from deepspeed.runtime.zero.partitioned_param_coordinator import iter_params

    optimizer = engine.optimizer
    params = list(iter_params(optimizer.parameter_offload.module, recurse=True))  # external ones too, as DeepSpeed's
    state.params = params
    # one rank holds every partition whole (no padding), on the device: the gather after the step is a view
    state.one_rank = all(
        dist.get_world_size(group=optimizer._get_param_partition_group(p)) == 1
        and p.ds_tensor.numel() == p.ds_numel and p.ds_tensor.device.type == torch.device(optimizer.device).type
        for p in params)
    optimizer.step = types.MethodType(_lean_step, optimizer)


def _lean_step(self, closure=None):
    """DeepSpeedZeroOptimizer_Stage3.step without offload, with the release, norm and gather batched."""
    from deepspeed.runtime.zero import stage3 as zero3

    from dstrain.speedups.offload_chunked_step_zero3 import checked_global_norm, warn_on_allocator_flushes

    scaled_global_grad_norm = checked_global_norm(self, lambda: release_all_parameters(self),
                                                  lambda: grad_norm_groups(self))
    if scaled_global_grad_norm is None:  # a skipped step, as DeepSpeed skips it
        return
    timer_names = {zero3.OPTIMIZER_STEP_TIMER}
    self.timers(zero3.OPTIMIZER_STEP_TIMER).start()
    self.zero_grad(set_to_none=True)  # the gradients are in the partition buffers already
    for sub_group_id in range(len(self.fp16_groups)):
        prepare_fp32_grad(self, sub_group_id)
        self.unscale_and_clip_grads(sub_group_id, scaled_global_grad_norm)
        self._optimizer_step(sub_group_id)
        self._reassign_or_swap_out_partitioned_parameters(sub_group_id)
        self._release_sub_group(sub_group_id, timer_names)
    self.timers(zero3.OPTIMIZER_STEP_TIMER).stop()
    gather_persistent_parameters(self)
    self.invalidate_secondary_tensor()  # the rest of DeepSpeed's _post_step without offload or swapping
    self.timers.log(timer_names)
    warn_on_allocator_flushes(self)


def prepare_fp32_grad(self, sub_group_id: int) -> None:
    """DeepSpeed's _prepare_sub_group without offload or swapping: the sub-group's fp32 gradient for its update,
    from the gradient buffer's span where its partitions lie end to end there (see the module docstring), else
    DeepSpeed's flattened copy. An fp32 span is the buffer itself: the update's unscaling and clipping scale it
    in place, as they scale DeepSpeed's copy, and the next backward's first micro-step overwrites it."""
    master = self.fp32_partitioned_groups_flat[sub_group_id]
    span = end_to_end(self.averaged_gradients[sub_group_id], master)
    if span is None:
        self._prepare_fp32_grad_for_sub_group(sub_group_id)
        return
    master.grad = span.to(master.dtype)  # bf16 gradients: the one copy, as DeepSpeed's .to after its flatten
    self.averaged_gradients[sub_group_id] = None
    self.dstrain_speedups.grad_views += 1


def end_to_end(grads: list | None, like):
    """One tensor over `grads` where they are contiguous pieces of one storage, each starting where the one
    before ends, of one dtype, on `like`'s device, with its element count; None otherwise."""
    import torch

    if not grads:
        return None
    first = grads[0]
    storage, start, total = first.untyped_storage().data_ptr(), first.storage_offset(), 0
    for grad in grads:
        if (grad.dtype != first.dtype or grad.device != like.device or not grad.is_contiguous()
                or grad.untyped_storage().data_ptr() != storage or grad.storage_offset() != start + total):
            return None
        total += grad.numel()
    if total != like.numel():
        return None
    return first.as_strided((total,), (1,), start)


def release_all_parameters(self) -> None:
    """What DeepSpeed's _partition_all_parameters does: release every gathered parameter and clear what
    each module holds of it. Every parameter here has its partition already (checked when the step is
    installed), and for such a parameter DeepSpeed's partition call comes down to free_param; that is
    called directly. While a fetch is in flight DeepSpeed's own path runs, which waits for it."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus, free_param

    coordinator = self.parameter_offload.get_param_coordinator()
    if coordinator._PartitionedParameterCoordinator__inflight_param_registry:
        self._partition_all_parameters()
        return
    released = 0
    for param in self.dstrain_speedups.params:
        param.ds_active_sub_modules.clear()
        if param.ds_status == ZeroParamStatus.AVAILABLE:
            free_param(param)
            released += param.ds_numel
        elif param.ds_status != ZeroParamStatus.NOT_AVAILABLE:
            raise RuntimeError(f"{param.ds_summary()} expected to be released")
    coordinator._PartitionedParameterCoordinator__n_available_params -= released


def gather_persistent_parameters(self) -> None:
    """Gather the persistent parameters' updated partitions, as DeepSpeed's _post_step does, with one
    all-gather instead of one collective a parameter. On one rank there is nothing to gather: each
    parameter's data is its partition again, set here as DeepSpeed's no-gather handle sets it, but
    without the handle's wait, which synchronizes the host with the GPU's whole step (on CUDA): the
    partitions are on this device and written on its stream, so the next forward reads them in order.
    On several ranks: gather_into_views, unless the parameters need what only DeepSpeed's gather does."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    params = self.persistent_parameters
    if not params:
        return
    if not self.dstrain_speedups.one_rank:
        plan = _gather_plan(self)
        if plan is None:
            params[0].all_gather_coalesced(params).wait()  # checks the statuses itself
        else:
            _expect_released(params)
            gather_into_views(*plan)
        return
    _expect_released(params)
    for param in params:
        param.data = param.ds_tensor.data.view(param.ds_shape)
        param.ds_status = ZeroParamStatus.AVAILABLE


def _expect_released(params) -> None:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    for param in params:
        if param.ds_status != ZeroParamStatus.NOT_AVAILABLE:
            raise RuntimeError(f"{param.ds_summary()} expected to be released")


def _gather_plan(self):
    """(parameters in ds_id order, their partition group, its size, this rank's index in it) for
    gather_into_views, made once per list of persistent parameters; None where DeepSpeed's gather runs:
    with speedups.zero3_gather off, or for parameters in several partition groups, of several dtypes, or
    with a communication dtype of their own (torch autocast)."""
    import torch
    from deepspeed import comm as dist
    from deepspeed.runtime.torch_autocast import has_comm_dtype

    if not self.dstrain_speedups.lean_gather:  # speedups.zero3_gather off
        return None
    cached = self.dstrain_speedups.gather_plan
    if cached is not None and cached[0] is self.persistent_parameters:
        return cached[1]
    params = sorted(self.persistent_parameters, key=lambda p: p.ds_id)  # the same order on every rank
    groups = {id(self._get_param_partition_group(p)) for p in params}
    dtypes = {p.ds_tensor.dtype for p in params}
    plan = None
    if (len(groups) == 1 and len(dtypes) == 1 and not any(has_comm_dtype(p) for p in params)
            and hasattr(torch, "split_with_sizes_copy")):
        group = self._get_param_partition_group(params[0])
        plan = (params, group, dist.get_world_size(group=group), dist.get_rank(group=group))
    self.dstrain_speedups.gather_plan = (self.persistent_parameters, plan)
    return plan


def gather_into_views(params, group, world: int, rank: int) -> None:
    """Gather released parameters (gather_persistent_parameters checked) whole from their partitions,
    all in one all-gather, as FSDP2 gathers its parameters: every rank's partitions side by side into one flat buffer (this rank's copied into
    its own place, gathered in place as DeepSpeed does), then one copy that regroups them by parameter
    into a second buffer, whose slices become the parameters' data.
    DeepSpeed's coalesced gather makes the same single collective but regroups each parameter alone, in
    about 45 Python calls a parameter (narrows, a cat, the device and profiler lookups around them):
    on two CPU ranks, 8,800 of the step's 14,300 calls (benchmarks/zero_host_calls.py, removed after 05c256e), host work that a
    host-bound GPU step waits for."""
    import torch
    from deepspeed import comm as dist
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    partitions = [param.ds_tensor for param in params]  # each rank's share, padded to the same size
    sizes = [partition.numel() for partition in partitions]
    share = sum(sizes)
    gathered = torch.empty(world * share, dtype=partitions[0].dtype, device=partitions[0].device)
    mine = torch.cat(partitions, out=gathered.narrow(0, rank * share, share))
    dist.all_gather_into_tensor(gathered, mine, group=group)
    whole = torch.empty_like(gathered)  # parameter after parameter, each its ranks' shares in rank order
    chunks = torch.split(whole, [world * size for size in sizes])
    torch.split_with_sizes_copy(gathered.view(world, -1), sizes, dim=1,
                                out=[chunk.view(world, size) for chunk, size in zip(chunks, sizes)])
    for param, chunk in zip(params, chunks):
        param.data = chunk[:param.ds_numel].view(param.ds_shape)  # without the last share's padding
        param.ds_status = ZeroParamStatus.AVAILABLE


def grad_norm_groups(self) -> list:
    """Each sub-group's gradient norm as DeepSpeed's get_grad_norm_direct takes it (L2, in its norm dtype,
    fp64 where the device has it, summed over the partition group, -1 where it is not finite), from one
    multi-tensor norm per sub-group."""
    import torch
    from deepspeed import comm as dist
    from deepspeed.runtime.zero.utils import get_norm_dtype

    norms = []
    for sub_group_id, params in enumerate(self.fp16_groups):
        grads = self.averaged_gradients[sub_group_id]
        if not grads:
            norms.append(torch.zeros((), dtype=get_norm_dtype(), device=self.device))
            continue
        per_tensor = torch._foreach_norm([g.to(self.device, non_blocking=True) for g in grads], 2.0,
                                         dtype=get_norm_dtype())
        squares = torch.sum(torch.pow(torch.stack(per_tensor), 2.0))
        dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=self._get_param_partition_group(params[0]))
        total = squares**0.5
        norms.append(torch.where(total.isfinite(), total, torch.full_like(total, -1.0)))
    return norms
