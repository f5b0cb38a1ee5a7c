"""ZeRO-3 without offload: DeepSpeed's per-gradient host work in the backward made lean (registry:
zero3_grads; needs zero3_step).

The gradient hook's copy into the reduce bucket is the same narrow, copy and stream bookkeeping with its
invariants checked once instead of per call; the copies of the reduced partitions into the gradient
slots are one multi-tensor copy (or add) per bucket; and the backward's end makes the current stream
wait for the reduce stream on the device instead of the host. The same kernels' arithmetic: the weights
are DeepSpeed's to the bit (tests/test_zero3_step.py).
"""

from __future__ import annotations

import types

import torch


def applies(engine) -> str | None:
    """Why the lean bucket copy and batched partition copies do not cover `engine` (None: they do): they
    need contiguous gradients, one communication dtype without torch autocast, no AutoEP folding, and a
    DeepSpeed with the pieces they call (dstrain's ZeRO-3 step, their prerequisite, covers the rest)."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    optimizer = getattr(engine, "optimizer", None)
    if type(optimizer) is not DeepSpeedZeroOptimizer_Stage3:
        return "not ZeRO-3"
    needed = ("ipg_buckets", "reduce_and_partition_stream", "reduce_bucket_size", "contiguous_gradients",
              "communication_data_type", "micro_step_id", "gradient_accumulation_dtype",
              "_offload_boundary_param_ids", "_get_param_partition_group",
              "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads",
              "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition", "params_already_reduced",
              "averaged_gradients", "_epilogue_ran_this_backward")
    missing = [name for name in needed if not hasattr(optimizer, name)]
    if missing:
        return f"this DeepSpeed's stage-3 optimizer lacks {', '.join(missing)}"
    if not optimizer.contiguous_gradients:
        return "contiguous_gradients is off"
    try:
        from deepspeed.runtime.torch_autocast import is_autocast_initialized
    except ImportError:
        return "this DeepSpeed has no torch_autocast module"
    if is_autocast_initialized():
        return "torch autocast"
    if getattr(optimizer, "autoep_folding_tp_group", None) is not None:
        return "AutoEP folding"
    if list(optimizer.ipg_buckets) != [optimizer.communication_data_type]:
        return "several communication dtypes"
    return None


def install(engine, state) -> str | None:
    """Give `engine`'s ZeRO-3 optimizer the lean bucket copy and batched partition copies; why not (nothing
    changed) where the parameters are not all partitioned over one group."""
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator

    optimizer = engine.optimizer
    params = state.params
    group = optimizer._get_param_partition_group(params[0]) if params else None
    if group is None or any(optimizer._get_param_partition_group(p) is not group for p in params):
        return "the parameters are not all partitioned over one group"
    state.accelerator = get_accelerator()  # looked up once: the hooks below run per gradient
    state.partition_group = group
    state.partition_rank = dist.get_rank(group=group)
    optimizer.reduce_independent_p_g_buckets_and_remove_grads = types.MethodType(_add_to_bucket, optimizer)
    optimizer.partition_grads = types.MethodType(_partition_grads, optimizer)
    optimizer.independent_gradient_partition_epilogue = types.MethodType(_epilogue, optimizer)
    return None


def _add_to_bucket(self, param) -> None:
    """DeepSpeed's reduce_independent_p_g_buckets_and_remove_grads and __add_grad_to_ipg_bucket for this
    set-up: reduce the bucket first if the gradient does not fit, then copy it in on the reduce stream."""
    dtype = self.communication_data_type
    bucket = self.ipg_buckets[dtype]
    if bucket.elements + param.ds_numel > self.reduce_bucket_size and bucket.elements > 0:
        self._DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads(dtype)
    if not getattr(param, "ds_grad_is_ready", True):
        return
    grad = param.grad
    numel = grad.numel()
    accelerator = self.dstrain_speedups.accelerator
    stream = self.reduce_and_partition_stream
    if not accelerator.resolves_data_dependency():
        stream.wait_stream(accelerator.current_stream())
    if bucket.elements + numel <= self.reduce_bucket_size:  # else DeepSpeed reduces it where it is
        # no torch.no_grad() as DeepSpeed's: the hook runs in autograd's backward, where grad mode is off
        # (engine.backward never asks for a graph of the backward)
        with accelerator.stream(stream):
            flat = bucket.buffer.narrow(0, bucket.elements, numel).view_as(grad)
            flat.copy_(grad, non_blocking=True)
            if not accelerator.is_synchronized_device():
                grad.record_stream(stream)  # read on the reduce stream: not reused before it is done
            grad.data = flat
    bucket.params.append(param)
    bucket.process_group = self.dstrain_speedups.partition_group
    bucket.elements += numel


def _partition_grads(self, params_to_release: list, grad_partitions: list) -> list:
    """DeepSpeed's partition_grads without offload: this rank's reduced partitions copied into (on the
    first micro-step) or added to the parameters' gradient slots, one multi-tensor operation a bucket."""
    slots = self._DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition
    rank = self.dstrain_speedups.partition_rank
    buffers, sources = [], []
    for param, grad_partition in zip(params_to_release, grad_partitions):
        if param.partition_numel() * rank >= param.ds_numel:  # this rank's partition is all padding
            param.grad = None
            continue
        self._offload_boundary_param_ids.add(param.ds_id)
        buffers.append(slots[param.ds_id].narrow(0, 0, grad_partition.numel()))
        sources.append(grad_partition)
    if buffers:
        if self.micro_step_id == 0:  # don't accumulate
            torch._foreach_copy_(buffers, sources, non_blocking=True)
        else:
            torch._foreach_add_(buffers, [g.to(self.gradient_accumulation_dtype).view(b.shape)
                                          for g, b in zip(sources, buffers)])
    accelerator = self.dstrain_speedups.accelerator
    current = None if accelerator.is_synchronized_device() else accelerator.current_stream()
    for param in params_to_release:
        if current is not None and param.grad is not None:
            param.grad.record_stream(current)
        param.grad = None
    return buffers


def _epilogue(self) -> None:
    """DeepSpeed's independent_gradient_partition_epilogue without offload (its memory reports, off,
    left out): reduce what is left in the bucket and point the step at the gradient partitions. Where
    DeepSpeed then waits on the host for the reduce stream, which holds the host until the GPU has run
    the whole backward, the current stream waits for it on the device: everything that reads the
    partitions next (the step's norm and update, the next backward's additions) runs on it."""
    self._DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads(self.communication_data_type)
    accelerator = self.dstrain_speedups.accelerator
    if not accelerator.resolves_data_dependency():
        accelerator.current_stream().wait_stream(self.reduce_and_partition_stream)
    for param_id in self.params_already_reduced:
        self.params_already_reduced[param_id] = False
    slots = self._DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition
    for i, sub_group in enumerate(self.fp16_groups):
        self.averaged_gradients[i] = [slots[param.ds_id] if param.requires_grad else torch.zeros_like(param.ds_tensor)
                                      for param in sub_group]
    self._epilogue_ran_this_backward = True
