"""ZeRO-3 with the optimizer on the CPU: each gradient partition goes to the host once (registry:
offload_grads_zero3, offload_bf16_grads_zero3; offload_accumulate_zero3's sums are read here).

At a step's only micro-step DeepSpeed copies each reduced gradient partition to its pinned host buffer,
back to the GPU for its norm and fp32 cast, and to the host again. Where nothing reads the host buffer
afterwards (no accumulation, bf16 or fp32, no NVMe, ZenFlow or Muon) this does what is left: the norm on
the GPU and one fp32 copy to the host; with bf16 weights and accumulation the one copy carries bf16 into
DeepSpeed's host buffer, which the chunked step reads through dstrain's Adam op. With accumulation over
several micro steps the same boundary copy is made from the running sum that offload_accumulate_zero3
keeps on the GPU, where it is installed. Every other call is DeepSpeed's own method. The same values
(tests/test_offload_step_zero3.py)."""

from __future__ import annotations

import types


def applies(engine) -> str | None:
    """Why the direct gradient copy does not cover `engine` (None: it does): it needs ZeRO-3's own optimizer
    with its optimizer offloaded, bf16 or fp32 (fp16's overflow check scans the host buffer), no NVMe
    swapping, ZenFlow or Muon, on a DeepSpeed with the pieces it uses."""
    import torch
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    optimizer = getattr(engine, "optimizer", None)
    if type(optimizer) is not DeepSpeedZeroOptimizer_Stage3:
        return "not ZeRO-3's own optimizer"
    if not getattr(optimizer, "offload_optimizer", False):
        return "no ZeRO-3 CPU offload"
    needed = ("partition_grads", "micro_step_id", "is_gradient_accumulation_boundary", "grad_position",
              "get_param_id", "norm_for_param_grads", "fp32_partitioned_groups_flat", "_constant_buffered_norm2",
              "_get_param_partition_rank", "_offload_boundary_param_ids", "gradient_accumulation_dtype",
              "master_weights_and_grads_dtype", "dtype", "swap_optimizer", "zenflow", "use_muon")
    missing = [name for name in needed if not hasattr(optimizer, name)]
    if missing:
        return f"this DeepSpeed's stage-3 optimizer lacks {', '.join(missing)}"
    for flag, what in (("swap_optimizer", "NVMe swapping"), ("zenflow", "ZenFlow"), ("use_muon", "Muon")):
        if getattr(optimizer, flag):
            return what
    if optimizer.dtype == torch.float16:
        return "fp16 (its overflow check scans the host buffer)"
    return None


def install(engine, state) -> None:
    """Give `engine`'s ZeRO-3 CPU-offload optimizer the direct gradient copy."""
    optimizer = engine.optimizer
    state.deepspeed_partition_grads = optimizer.partition_grads
    optimizer.partition_grads = types.MethodType(_partition_grads, optimizer)


def bf16_grads_apply(engine) -> str | None:
    """Why the direct copy cannot send bf16 into DeepSpeed's host gradient buffer for the chunked step
    to read (None: it can): that needs bf16 weights and gradient accumulation in bf16, and the buffer laid
    out as the sub-groups. The fp32 gradient buffer is then not written in such steps (`safe_get_full_grad`
    between backward and step would read stale values)."""
    import torch

    optimizer = engine.optimizer
    if optimizer.dtype != torch.bfloat16 or optimizer.gradient_accumulation_dtype != torch.bfloat16:
        return "the weights or the gradient accumulation are not bf16"
    if _sub_group_views(optimizer) is None:
        return "DeepSpeed's host gradient buffer is not laid out as the sub-groups"
    return None


def install_bf16_grads(engine, state) -> None:
    """The direct copy sends bf16, read by the chunked step through dstrain's Adam op (state.adam_op)."""
    state.bf16_grads = (state.adam_op, _sub_group_views(engine.optimizer))
    state.grads_in_bf16 = False  # set by each partition_grads call: which buffer this step reads


def _sub_group_views(optimizer):
    """Per sub-group, the stretch of DeepSpeed's host gradient buffer that holds its parameters'
    partitions at the offsets of its fp32 partition; None where the layout differs."""
    import torch

    flat = getattr(optimizer, "grad_partitions_flat_buffer", None)
    by_param = getattr(optimizer, "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition", None)
    if flat is None or by_param is None or flat.dtype != torch.bfloat16 or flat.device.type != "cpu":
        return None
    views = []
    for sub_group, params in enumerate(optimizer.fp16_groups):
        size = optimizer.fp32_partitioned_groups_flat[sub_group].numel()
        if not params or size != sum(p.partition_numel() for p in params):
            return None
        start = (by_param[params[0].ds_id].data_ptr() - flat.data_ptr()) // flat.element_size()
        for param in params:
            group, offset, _ = optimizer.grad_position[optimizer.get_param_id(param)]
            view = by_param[param.ds_id]
            if group != sub_group or view.data_ptr() != flat[start + offset:].data_ptr():
                return None
        views.append(flat.narrow(0, start, size))
    return views


def _partition_grads(self, params_to_release, grad_partitions):
    """partition_grads at a step's boundary micro-step: norm and fp32 copy straight from the GPU (bf16
    into DeepSpeed's host buffer, with bf16_zero3_offload_grads), from the partition itself at a step's
    only micro-step, or from its running sum on the GPU (offload_accumulate_zero3), which the micro steps
    before the boundary only add to. Anything else (accumulation without those sums, a rounding the host
    buffer would have done) is DeepSpeed's method."""
    import torch
    from deepspeed.accelerator import get_accelerator

    state = self.dstrain_speedups
    sums = state.grad_sums  # ds_id -> the parameter's running sum on the GPU, or None
    boundary = self.is_gradient_accumulation_boundary()
    accumulate = self.gradient_accumulation_dtype
    if sums is None and (self.micro_step_id != 0 or not boundary
                         or any(g.dtype != accumulate and accumulate != torch.float32 for g in grad_partitions)):
        state.grads_in_bf16 = False  # DeepSpeed's copies fill the fp32 buffer the step reads
        return state.deepspeed_partition_grads(params_to_release, grad_partitions)
    in_bf16 = state.bf16_grads is not None
    state.grads_in_bf16 = in_bf16
    by_param = self._DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition if in_bf16 else None
    record = not get_accelerator().is_synchronized_device()
    for param, grad_partition in zip(params_to_release, grad_partitions):
        if param.partition_numel() * self._get_param_partition_rank(param) >= param.ds_numel:
            param.grad = None  # this rank's partition of the parameter is padding only
            continue
        self._offload_boundary_param_ids.add(param.ds_id)  # as DeepSpeed records it
        if sums is not None:
            # DeepSpeed's arithmetic on its host buffer, done in place on the GPU: the first micro step
            # copies (the partition is in grad_accum_dtype already), later ones add in that dtype.
            total = sums[param.ds_id].narrow(0, 0, grad_partition.numel())
            if self.micro_step_id == 0:
                total.copy_(grad_partition)
            else:
                total.add_(grad_partition.to(accumulate).view(total.shape))
            grad_partition = total
        if boundary:
            param_id = self.get_param_id(param)
            sub_group, offset, _ = self.grad_position[param_id]
            # The same values as DeepSpeed's: its host buffer held this partition (or sum) unchanged, in
            # the same dtype, or widened to fp32, which the norm and the cast below do anyway.
            self.norm_for_param_grads[param_id] = self._constant_buffered_norm2(grad_partition)
            if in_bf16:  # the step widens it on the host (offload_step_zero3.py)
                by_param[param.ds_id].narrow(0, 0, grad_partition.numel()).copy_(grad_partition, non_blocking=True)
            else:
                fp32_grad = self.fp32_partitioned_groups_flat[sub_group].grad.narrow(0, offset, grad_partition.numel())
                fp32_grad.copy_(grad_partition.to(dtype=self.master_weights_and_grads_dtype), non_blocking=True)
        if record and param.grad is not None:
            param.grad.record_stream(get_accelerator().current_stream())
        param.grad = None
