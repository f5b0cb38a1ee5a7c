"""ZeRO-3: the parameter partitions flattened on the device at engine start, instead of through host
memory (registry: zero3_flatten; switch speedups.flatten_on_device).

DeepSpeed's `defragment` copies every partition to pageable host memory and back to build the flat
buffer without holes. Here the buffer is filled on the device while the partitions still exist, and
their old blocks are handed back afterwards, which leaves no holes either: the same values and layout
(tests/test_zero3_flatten.py). It needs room for a second copy for a moment; without it DeepSpeed's
path runs.
"""

from __future__ import annotations

from contextlib import contextmanager

HEADROOM_BYTES = 2 << 30  # kept free beyond the second copy: the allocator's own slack, other processes


def flatten_on_device(tensors):
    """The partitions `tensors` (one dtype, one device) moved into one contiguous buffer on their device,
    each tensor's data now a view of it; the buffer is returned (as DeepSpeed's `defragment` does)."""
    import torch
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.utils import defragment, get_mapping_to_flat_buffer

    device, dtype = tensors[0].device, tensors[0].dtype
    numel = sum(t.numel() for t in tensors)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if free < numel * tensors[0].element_size() + HEADROOM_BYTES:
            return defragment(tensors)  # no room for two copies: through the host, as DeepSpeed does
    buffer = torch.empty(numel, dtype=dtype, device=device)
    for tensor, offset, size in get_mapping_to_flat_buffer(tensors):
        view = buffer.narrow(0, offset, size)
        view.copy_(tensor.view(-1))
        tensor.data = view
    get_accelerator().empty_cache()  # the partitions' old blocks go back to the driver: no holes left
    return buffer


@contextmanager
def partitions_flattened_on_device():
    """While it is open, ZeRO-3 engines built by deepspeed.initialize flatten with flatten_on_device
    (the registry opens it around deepspeed.initialize)."""
    from deepspeed.runtime.zero import stage3

    original = stage3.defragment
    stage3.defragment = flatten_on_device
    try:
        yield
    finally:
        stage3.defragment = original


def applies(engine=None) -> str | None:
    """Why the flattening does not cover the engine about to be built (engine None) or `engine` (None: it
    does): DeepSpeed's stage-3 module must have its `defragment`, and a built engine be ZeRO-3."""
    from deepspeed.runtime.zero import stage3

    if not hasattr(stage3, "defragment"):
        return "this DeepSpeed's stage3 module has no defragment"
    if engine is not None and not isinstance(getattr(engine, "optimizer", None), stage3.DeepSpeedZeroOptimizer_Stage3):
        return "not ZeRO-3"
    return None
