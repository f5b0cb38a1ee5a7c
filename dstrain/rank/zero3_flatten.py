"""ZeRO-3's parameter partitions flattened on the GPU at engine start, instead of through host memory.

DeepSpeed 0.19's stage-3 optimizer moves every rank's 16-bit parameter partitions into one flat buffer
(`deepspeed.runtime.zero.utils.defragment`) by copying them to pageable host memory, freeing them, and
copying the buffer back, so that the flat buffer does not sit between freed blocks. On the 913M GPT on
one H100 that round trip was 2.1 s of the engine's start (docs/benchmarks.md, finding 33). Here the
buffer is allocated on the device while the partitions still exist, filled there, and the partitions'
blocks are handed back to the driver afterwards (empty_cache), which leaves no holes either. The
values and the buffer's layout are the same. It needs a second copy of the partitions for a moment,
so only where the device has that free with room to spare; otherwise DeepSpeed's own path runs.
DSTRAIN_FLATTEN_ON_DEVICE=off keeps DeepSpeed's path everywhere.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

from dstrain.switches import switched_off

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
    """While it is open, ZeRO-3 engines built by deepspeed.initialize flatten with flatten_on_device."""
    from deepspeed.runtime.zero import stage3

    if switched_off(os.environ, "DSTRAIN_FLATTEN_ON_DEVICE"):
        yield
        return
    original = stage3.defragment
    stage3.defragment = flatten_on_device
    try:
        yield
    finally:
        stage3.defragment = original
