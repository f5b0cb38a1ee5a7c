"""ZeRO-1/2 with the optimizer on the CPU: two per-parameter waits for the GPU taken out of the backward
(registry: offload_syncs).

DeepSpeed's offload gradient hook checks each gradient for inf/NaN on the host even where nothing reads
the answer (the overflow check is off), and sums the gradient norm from one `.item()` per parameter;
each is a host-GPU synchronisation that keeps the host from running ahead. The replacements compute the
same values: no tracker where it is never read, the norm from one reduction on the device.
"""

from __future__ import annotations

import math
import types


def applies(engine) -> str | None:
    """Why `engine` is not a ZeRO-1/2 CPU-offload optimizer with these methods (None: it is)."""
    optimizer = getattr(engine, "optimizer", None)
    if not getattr(optimizer, "cpu_offload", False):
        return "no ZeRO-1/2 CPU offload"
    needed = ("update_offload_overflow_tracker", "complete_grad_norm_calculation_for_cpu_offload",
              "norm_for_param_grads", "check_grad_overflow", "get_param_id")
    missing = [name for name in needed if not hasattr(optimizer, name)]
    return f"this DeepSpeed's ZeRO-1/2 optimizer lacks {', '.join(missing)}" if missing else None


def install(engine, state) -> None:
    """Patch `engine`'s ZeRO-1/2 CPU-offload optimizer in place."""
    optimizer = engine.optimizer
    if not optimizer.check_grad_overflow:  # local_overflow is read only by the overflow check
        optimizer.update_offload_overflow_tracker = _no_overflow_tracking
    optimizer.complete_grad_norm_calculation_for_cpu_offload = types.MethodType(_grad_norm_on_device, optimizer)


def _no_overflow_tracking(_grad) -> None:
    return None


def _grad_norm_on_device(self, params):
    """DeepSpeed's complete_grad_norm_calculation_for_cpu_offload with one wait instead of one per
    parameter: the same parameters counted, the squares summed in float64 as its Python floats are,
    the same all-reduces, and -1.0 for a non-finite norm."""
    import torch
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.utils import is_model_parallel_parameter

    norms = []
    for p in params:
        if getattr(p, "ds_pipe_replicated", False):  # pipeline-replicated: counted by another stage
            continue
        if is_model_parallel_parameter(p) or self.model_parallel_rank == 0:
            param_id = self.get_param_id(p)
            if param_id in self.norm_for_param_grads:
                norms.append(self.norm_for_param_grads[param_id])
            else:
                assert self.ignore_unused_parameters, (
                    "a trainable parameter took no part in the loss; set "
                    "deepspeed.zero_optimization.ignore_unused_parameters=true or use every parameter")
    device = get_accelerator().current_device_name()
    total = torch.zeros(1, dtype=torch.float32, device=device)
    if norms:
        squares = torch.stack([n.reshape(()).to(device=device, dtype=torch.float64) for n in norms]).pow(2).sum()
        total += squares.to(torch.float32)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.dp_process_group)
    self._model_parallel_all_reduce(tensor=total, op=dist.ReduceOp.SUM)
    norm = total[0].item() ** 0.5
    return torch.tensor(norm if math.isfinite(norm) else -1.0, device=self.device, dtype=torch.float)

