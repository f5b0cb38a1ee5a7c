"""DeepSpeed's CUDA accelerator looks the current stream up by the current device's index.

DeepSpeed asks its accelerator for the current stream several times per parameter per step, and
torch.cuda.current_stream() without a device finds the device through torch.cuda.is_available() and an
environment lookup each time; with the index it gives the same stream, for less host time.
"""

from __future__ import annotations

import contextlib


def applies(engine=None) -> str | None:
    """Why DeepSpeed's accelerator here is not CUDA's on a usable GPU (None: it is)."""
    import torch
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cuda" or not torch.cuda.is_available():
        return "not a CUDA accelerator"
    return None


def install(engine=None, state=None) -> None:
    """Give DeepSpeed's accelerator a current_stream that passes the current device's index to torch."""
    import torch
    from deepspeed.accelerator import get_accelerator

    current_device, current_stream = torch.cuda.current_device, torch.cuda.current_stream

    def current_stream_of(device_index=None):
        return current_stream(current_device() if device_index is None else device_index)

    get_accelerator().current_stream = current_stream_of


def installed():
    """install(), as a context manager for the registry's engine build (the change stays after it)."""
    install()
    return contextlib.nullcontext()
