"""ZeRO-3 with the optimizer on the CPU: each gradient partition goes to the host once, in fp32, instead of
making a round trip first (DeepSpeed 0.19's DeepSpeedZeroOptimizer_Stage3.partition_grads).

With `offload_optimizer`, DeepSpeed keeps its gradient partitions (`grad_partitions_flat_buffer`) in pinned
host memory. At the last micro-step of an optimizer step it copies each reduced gradient partition from
the GPU into that host buffer, copies it straight back to the GPU to take its norm and cast it to fp32,
and then copies the fp32 gradient to the host a second time, into the optimizer's gradient buffer. Per
parameter that is 6 bytes to the host and 2 back, where 4 to the host carry everything the step reads;
the extra copy to the GPU also shares the bus with the next parameters' fetch in the backward.

Where nothing reads the host buffer afterwards, this does what is left: the norm from the partition on
the GPU and one fp32 copy to the host. That is the case when the step is not accumulating (its first
micro-step is also its last), with bf16 or fp32 training (fp16's overflow check scans the host buffer)
and no NVMe, ZenFlow or Muon. Every other call goes to DeepSpeed's own method. The fp32 gradients and
norms are the same values (tests/test_offload_step_zero3.py compares the trained weights bit for bit).

With bf16 weights and gradients (`bf16_zero3_offload_grads`, once the chunked step is installed) the
one copy carries 2 bytes a parameter: the bf16 partition goes into DeepSpeed's host buffer, which has the
sub-groups' layout, and the chunked step reads it there through dstrain's Adam op, which widens it in
cache (offload_step.py). Steps that took DeepSpeed's copies (accumulation) read the fp32 buffer as before.
"""

from __future__ import annotations

import types


def direct_zero3_offload_grads(engine) -> bool:
    """Give `engine`'s ZeRO-3 CPU-offload optimizer the direct gradient copy; False (nothing changed) for
    another optimizer or a set-up it does not cover: no optimizer offload, NVMe swapping, fp16, ZenFlow,
    Muon, a subclass (SuperOffload), or a DeepSpeed without the pieces it uses."""
    import torch
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    optimizer = getattr(engine, "optimizer", None)
    if type(optimizer) is not DeepSpeedZeroOptimizer_Stage3:
        return False
    needed = ("partition_grads", "micro_step_id", "is_gradient_accumulation_boundary", "grad_position",
              "get_param_id", "norm_for_param_grads", "fp32_partitioned_groups_flat", "_constant_buffered_norm2",
              "_get_param_partition_rank", "_offload_boundary_param_ids", "gradient_accumulation_dtype",
              "master_weights_and_grads_dtype", "dtype")
    if (not getattr(optimizer, "offload_optimizer", False) or getattr(optimizer, "swap_optimizer", True)
            or getattr(optimizer, "zenflow", True) or getattr(optimizer, "use_muon", True)
            or not all(hasattr(optimizer, name) for name in needed)
            or optimizer.dtype == torch.float16):  # the overflow check scans the host buffer
        return False
    optimizer._dstrain_deepspeed_partition_grads = optimizer.partition_grads
    optimizer.partition_grads = types.MethodType(_partition_grads, optimizer)
    return True


def bf16_zero3_offload_grads(engine) -> bool:
    """Send the direct copy's gradients in bf16 into DeepSpeed's host gradient buffer, for the chunked step
    to read (offload_step_zero3.py); False (nothing changed) without the direct copy and the chunked step,
    without bf16 weights and gradient accumulation in bf16, where that buffer's layout is not the
    sub-groups' own, or where dstrain's Adam op cannot be built. The fp32 gradient buffer is then not
    written in such steps (`safe_get_full_grad` between backward and step would read stale values)."""
    import torch

    from dstrain.rank.adam_nogil import adam_without_gil
    from dstrain.rank.offload_step_zero3 import has_chunked_step

    optimizer = getattr(engine, "optimizer", None)
    if (getattr(optimizer, "_dstrain_deepspeed_partition_grads", None) is None or not has_chunked_step(optimizer)
            or optimizer.dtype != torch.bfloat16 or optimizer.gradient_accumulation_dtype != torch.bfloat16):
        return False
    views = _sub_group_views(optimizer)
    op = adam_without_gil(optimizer.optimizer) if views is not None else None
    if op is None:
        return False
    optimizer._dstrain_bf16_grads = (op, views)
    optimizer._dstrain_grads_in_bf16 = False  # set by each partition_grads call: which buffer this step reads
    return True


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
    """partition_grads for a step's only micro-step: norm and fp32 copy straight from the GPU partition
    (bf16 into DeepSpeed's host buffer, with bf16_zero3_offload_grads). Anything else (accumulation, a
    rounding the host buffer would have done) is DeepSpeed's method."""
    import torch
    from deepspeed.accelerator import get_accelerator

    accumulate = self.gradient_accumulation_dtype
    if (self.micro_step_id != 0 or not self.is_gradient_accumulation_boundary()
            or any(g.dtype != accumulate and accumulate != torch.float32 for g in grad_partitions)):
        self._dstrain_grads_in_bf16 = False  # DeepSpeed's copies fill the fp32 buffer the step reads
        return self._dstrain_deepspeed_partition_grads(params_to_release, grad_partitions)
    in_bf16 = getattr(self, "_dstrain_bf16_grads", None) is not None
    self._dstrain_grads_in_bf16 = in_bf16
    by_param = self._DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition if in_bf16 else None
    record = not get_accelerator().is_synchronized_device()
    for param, grad_partition in zip(params_to_release, grad_partitions):
        if param.partition_numel() * self._get_param_partition_rank(param) >= param.ds_numel:
            param.grad = None  # this rank's partition of the parameter is padding only
            continue
        self._offload_boundary_param_ids.add(param.ds_id)  # as DeepSpeed records it
        param_id = self.get_param_id(param)
        sub_group, offset, _ = self.grad_position[param_id]
        # The same values as DeepSpeed's: the host buffer held the partition unchanged (same dtype), or
        # widened to fp32, which the norm and the cast below do anyway.
        self.norm_for_param_grads[param_id] = self._constant_buffered_norm2(grad_partition)
        if in_bf16:  # the step widens it on the host (offload_step_zero3.py)
            by_param[param.ds_id].narrow(0, 0, grad_partition.numel()).copy_(grad_partition, non_blocking=True)
        else:
            fp32_grad = self.fp32_partitioned_groups_flat[sub_group].grad.narrow(0, offset, grad_partition.numel())
            fp32_grad.copy_(grad_partition.to(dtype=self.master_weights_and_grads_dtype), non_blocking=True)
        if record and param.grad is not None:
            param.grad.record_stream(get_accelerator().current_stream())
        param.grad = None
