"""ZeRO-2 with the optimizer on the CPU and gradient accumulation: the summed gradients stay on the GPU
between micro steps (registry: offload_accumulate_zero12).

DeepSpeed keeps each parameter's running gradient sum in a host buffer (`accumulated_grads_in_cpu`) and
at every micro step copies it to the GPU, adds the new gradient and copies the sum back: the whole
parameter in its dtype, each way, every micro step. Here the buffers are on the GPU, in the same dict, so
DeepSpeed's other readers of it (the boundary restore of unmanaged accumulation) find them unchanged in
meaning: the same add, in the same dtype and order, from zeros as DeepSpeed's start, so the sums and all
that follows are DeepSpeed's bit for bit (tests/test_offload_syncs.py). Non-boundary micro steps move
nothing over the bus; the boundary still sends the sum to the host once, as DeepSpeed's fp32 partition
copy. The price is GPU memory: one buffer per parameter of this rank's partition, its full size in its
dtype (`device_bytes`).
"""

from __future__ import annotations

import types

# auto leaves at least this much of the device's memory free once the buffers are made: the forward's
# activations are not yet allocated when dstrain applies its changes, and their peak is not known.
AUTO_HEADROOM = 0.25


def applies(engine) -> str | None:
    """Why the GPU-resident sums do not cover `engine` (None: they do): they need DeepSpeed's ZeRO-2
    CPU-offload optimizer with accumulation over more than one micro step and fp32 master weights, without
    ZenFlow, on a DeepSpeed with the pieces it replaces."""
    optimizer = getattr(engine, "optimizer", None)
    if not getattr(optimizer, "cpu_offload", False):
        return "no ZeRO-1/2 CPU offload"
    needed = ("async_accumulate_grad_in_cpu_via_gpu", "accumulated_grads_in_cpu", "temp_grad_buffer_for_gpu_offload",
              "get_param_id", "get_param_gradient_attribute", "micro_step_id", "params_in_partition",
              "partition_gradients", "gradient_accumulation_steps", "low_precision_master_weights_and_grads",
              "_use_compact_grad_partition_buffer", "dtype")
    missing = [name for name in needed if not hasattr(optimizer, name)]
    if missing:
        return f"this DeepSpeed's ZeRO-1/2 optimizer lacks {', '.join(missing)}"
    if optimizer.gradient_accumulation_steps <= 1:
        return "no gradient accumulation"  # registry.NO_ACCUMULATION: rank 0 says nothing of it
    # ZeRO-1 reduces and offloads its gradients once, at the boundary: no host round trips to save.
    if not optimizer.partition_gradients:
        return "ZeRO-1 (its gradients reach the host once a step already)"
    if getattr(optimizer, "zenflow", False):
        return "ZenFlow"
    # DeepSpeed then accumulates into the host gradient partition itself, which the step reads.
    if optimizer.low_precision_master_weights_and_grads:
        return "low-precision master weights"
    if not any(_host_accumulated(optimizer, i) for i in range(len(optimizer.params_in_partition))):
        return "fp32 gradient accumulation (DeepSpeed's compact gradient buffer, on the GPU already)"
    return None


def device_bytes(optimizer) -> int:
    """The GPU memory the buffers take: the whole of each parameter of this rank's partition that
    DeepSpeed would accumulate on the host (params straddling the partition's edge count whole, as
    DeepSpeed's host buffers do), in its dtype."""
    return sum(p.numel() * p.element_size() for i, group in enumerate(optimizer.params_in_partition)
               if _host_accumulated(optimizer, i) for p in group if p.requires_grad)


def fits(optimizer) -> str | None:
    """auto's rule for these buffers: why they stay off (None: they go on)."""
    return auto_refusal(device_bytes(optimizer), optimizer.temp_grad_buffer_for_gpu_offload.device)


def auto_refusal(needed: int, device) -> str | None:
    """auto's rule for both stages' GPU sums (offload_accumulate_zero3.py too): only on a CUDA device (a CPU
    accelerator's buffers are host memory already), and only where `needed` bytes leave AUTO_HEADROOM of
    its memory free; the reason where not."""
    import torch
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cuda":
        return f"auto: a {get_accelerator().device_name()} accelerator, not CUDA (no bus to spare)"
    free, total = torch.cuda.mem_get_info(device)
    if free - needed < AUTO_HEADROOM * total:
        return (f"auto: its {needed / 2**30:.1f} GiB of GPU buffers would leave less than "
                f"{AUTO_HEADROOM:.0%} of the GPU free ({free / 2**30:.1f} of {total / 2**30:.1f} GiB free)")
    return None


def install(engine, state, auto: bool = False) -> str | None:
    """Keep `engine`'s accumulated gradients on the GPU; with `auto`, only where they fit (a reason
    where they do not: nothing changed)."""
    optimizer = engine.optimizer
    if auto:
        reason = fits(optimizer)
        if reason is not None:
            return reason
    state.accumulate_bytes = device_bytes(optimizer)
    optimizer.async_accumulate_grad_in_cpu_via_gpu = types.MethodType(_accumulate_on_device, optimizer)
    return None


def _host_accumulated(optimizer, group_index: int) -> bool:
    # a group with DeepSpeed's compact fp32 buffer never goes through accumulated_grads_in_cpu
    return not optimizer._use_compact_grad_partition_buffer(group_index)


def _accumulate_on_device(self, param):
    """DeepSpeed's async_accumulate_grad_in_cpu_via_gpu (full-precision masters) with the running sum in a
    buffer on the device: made of zeros in the parameter's dtype as DeepSpeed's host buffer is, added to
    the gradient after passing through the optimizer's dtype as DeepSpeed's staging copy does, and
    overwritten with the new sum at every call, the boundary's included (ZeRO-2 overwrites it before
    reading it at the next step's first micro step). No host copy, so no copy to record or wait for."""
    import torch

    param_id = self.get_param_id(param)
    grad = self.get_param_gradient_attribute(param).data.view(-1)
    buffer = self.accumulated_grads_in_cpu.get(param_id)
    if buffer is None:
        buffer = torch.zeros(param.numel(), dtype=param.dtype, device=self.temp_grad_buffer_for_gpu_offload.device)
        self.accumulated_grads_in_cpu[param_id] = buffer
    if self.micro_step_id > 0:
        grad.add_(buffer if buffer.dtype == self.dtype else buffer.to(self.dtype))
    buffer.copy_(grad)
