"""What dstrain's changes keep between calls, in one object on DeepSpeed's optimizer (its one attribute,
STATE_ATTRIBUTE), instead of attributes of their own spread over DeepSpeed's object."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

STATE_ATTRIBUTE = "dstrain_speedups"


@dataclass
class SpeedupState:
    """Set by the changes as the registry installs them (dstrain/speedups/registry.py); read by the
    methods they put on the optimizer."""

    applied: list[str] = field(default_factory=list)
    """The registry's names of the changes installed on this engine, in order."""
    refused: dict[str, str] = field(default_factory=dict)
    """The registry's names of the changes that did not apply, with why."""
    adam_op: Any = None
    """dstrain's build of DeepSpeed's CPU Adam kernel (cpu_adam_nogil), where a change needs it."""
    # ZeRO-3 without offload (zero3_step, zero3_grads)
    params: list = field(default_factory=list)
    """Every parameter the ZeRO-3 step releases, external ones too, as DeepSpeed's."""
    one_rank: bool = False
    """One rank holds every partition whole on the device: the gather after the step is a view."""
    lean_gather: bool = False
    """The persistent parameters' gather regrouped in one copy (zero3_gather)."""
    gather_plan: Any = None
    """(the persistent parameter list it was made for, the plan), made once."""
    unhooked: int = 0
    """Modules whose hooks zero3_hooks took off."""
    grad_views: int = 0
    """Sub-group updates whose fp32 gradient was the gradient buffer's span, not a flattened copy (zero3_step)."""
    accelerator: Any = None
    partition_group: Any = None
    partition_rank: int = 0
    # CPU offload (offload_*)
    chunk: int | None = None
    """Elements per chunk of the chunked step; None where it is not installed."""
    copies_done: Any = None
    """ZeRO-1/2: an event after the last step's copies to the accelerator."""
    staging: Any = None
    """Chunks of weights on the accelerator, made on first use (ZeRO-1/2: fp32; ZeRO-3: (fp32, bf16))."""
    bf16_grads: Any = None
    """Gradients reach the host in bf16: ZeRO-1/2 (op, tile), ZeRO-3 (op, per-sub-group views)."""
    grads_in_bf16: bool = False
    """ZeRO-3: this step's gradients came in bf16 (set by each partition_grads call)."""
    round_op: Any = None
    """ZeRO-3 with parameter offload: the op that rounds the new weights to bf16 in the Adam pass."""
    deepspeed_partition_grads: Any = None
    """ZeRO-3: DeepSpeed's own partition_grads, for the calls the direct copy leaves to it."""
    grad_sums: Any = None
    """ZeRO-3 with accumulation (offload_accumulate_zero3): ds_id -> the parameter's running gradient sum
    on the GPU, read by the direct copy's partition_grads; None where DeepSpeed's host buffer sums them."""
    accumulate_bytes: int = 0
    """The GPU memory the accumulated gradients' buffers take (offload_accumulate_*)."""
    kept_weight_bytes: int = 0
    """ZeRO-3 with parameter offload: the GPU memory the weights kept between micro steps take at most
    (offload_keep_weights)."""
    overlap: Any = None
    """ZeRO-3: the worker thread that runs the step beside the next forward (StepBesideForward)."""


def state_of(engine_or_optimizer) -> SpeedupState | None:
    """The state of dstrain's changes on an engine (or its optimizer); None where none were considered."""
    optimizer = getattr(engine_or_optimizer, "optimizer", engine_or_optimizer)
    return getattr(optimizer, STATE_ATTRIBUTE, None)


def ensure_state(optimizer) -> SpeedupState:
    """The optimizer's state object, made on first use."""
    state = getattr(optimizer, STATE_ATTRIBUTE, None)
    if state is None:
        state = SpeedupState()
        setattr(optimizer, STATE_ATTRIBUTE, state)
    return state
