"""ZeRO-3 with the optimizer on the CPU and gradient accumulation: the gradient partitions are summed on
the GPU between micro steps (registry: offload_accumulate_zero3; needs offload_grads_zero3).

DeepSpeed sums each parameter's gradient partition in its pinned host buffer: at every micro step after
the first it copies the running sum to the GPU, adds the new partition and copies the sum back (at the
first it copies down and up again), so each micro step moves the whole partition over the bus twice.
Here the running sums live in one GPU buffer laid out as DeepSpeed's host buffer, in its dtype
(grad_accum_dtype), started from its contents: the same copy at the first micro step and the same `add_`
after it, on the same stream, so the sums are DeepSpeed's bit for bit. Nothing crosses the bus until the
boundary, where offload_grads_zero3's direct copy takes the norm from the sum and sends it to the host
once (tests/test_offload_step_zero3.py). The price is GPU memory: this rank's partition of every
parameter in that dtype (`device_bytes`).

Between micro steps the host buffer is no longer the running sum. In DeepSpeed 0.19.8 only three things
read it: fp16's overflow check (fp16 is outside offload_grads_zero3), the finalize of unmanaged
accumulation (excluded below) and `offload_states`, which moves it and would leave these buffers in place.
`safe_get_full_grad` and the fp32 gradient readers read the fp32 partition, which DeepSpeed too writes
only at the boundary.
"""

from __future__ import annotations

# auto's rule is shared with ZeRO-1/2's buffers of the same switch.
from dstrain.speedups.offload_accumulate_zero12 import auto_refusal


def applies(engine) -> str | None:
    """Why the GPU-resident sums do not cover `engine` (None: they do): they need accumulation over more
    than one micro step, managed by the engine (unmanaged accumulation's finalize reads the host buffer
    at step()), and the host buffer they shadow. offload_grads_zero3, their prerequisite, covers the rest."""
    optimizer = getattr(engine, "optimizer", None)
    needed = ("grad_partitions_flat_buffer", "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition",
              "gradient_accumulation_steps")
    missing = [name for name in needed if not hasattr(optimizer, name)]
    if missing:
        return f"this DeepSpeed's stage-3 optimizer lacks {', '.join(missing)}"
    if not hasattr(engine, "managed_gradient_accumulation"):
        return "this DeepSpeed's engine lacks managed_gradient_accumulation"
    if not engine.managed_gradient_accumulation():
        return "unmanaged gradient accumulation (DeepSpeed's finalize at step() reads the host buffer)"
    if optimizer.gradient_accumulation_steps <= 1:
        return "no gradient accumulation"  # registry.NO_ACCUMULATION: rank 0 says nothing of it
    if optimizer.grad_partitions_flat_buffer is None:
        return "no host gradient buffer"
    return None


def device_bytes(optimizer) -> int:
    """The GPU memory the sums take: DeepSpeed's host gradient buffer's size (this rank's partition of
    every parameter, in grad_accum_dtype)."""
    flat = optimizer.grad_partitions_flat_buffer
    return flat.numel() * flat.element_size()


def fits(optimizer) -> str | None:
    """auto's rule (ZeRO-2's too): why the sums stay off (None: they go on)."""
    import torch
    from deepspeed.accelerator import get_accelerator

    return auto_refusal(device_bytes(optimizer), torch.device(get_accelerator().current_device_name()))


def install(engine, state, auto: bool = False) -> str | None:
    """Sum `engine`'s gradient partitions on the GPU between micro steps (read by offload_grads_zero3's
    partition_grads through state.grad_sums); with `auto`, only where `fits` says so (a reason where
    not: nothing changed)."""
    from deepspeed.accelerator import get_accelerator

    optimizer = engine.optimizer
    if auto:
        reason = fits(optimizer)
        if reason is not None:
            return reason
    flat = optimizer.grad_partitions_flat_buffer
    by_param = optimizer._DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition
    # Started from the host buffer's contents: a parameter without a gradient at a step's first micro
    # step is added to what DeepSpeed's buffer would hold then, as DeepSpeed does. A blocking copy: the
    # sums are then used on the reduce stream only.
    sums = flat.to(get_accelerator().current_device_name())
    if sums.data_ptr() == flat.data_ptr():
        sums = flat.clone()  # a CPU accelerator: a buffer of its own all the same
    views = {}
    for ds_id, view in by_param.items():
        start = (view.data_ptr() - flat.data_ptr()) // flat.element_size()
        if view.dtype != flat.dtype or not 0 <= start <= flat.numel() - view.numel():
            return "a parameter's host gradient partition is not inside DeepSpeed's flat buffer"
        views[ds_id] = sums.narrow(0, start, view.numel())
    state.grad_sums = views
    state.accumulate_bytes = device_bytes(optimizer)
    return None


def describe(state) -> str:
    """Rank 0's words for it."""
    size = state.accumulate_bytes
    shown = f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"
    return f"gradients accumulated on the GPU ({shown})"
