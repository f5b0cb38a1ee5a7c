"""ZeRO-3 with the parameters offloaded, one GPU: a fetched parameter's copy is waited for by the GPU,
not the host (registry: offload_fetch_wait).

Where a parameter's partition is the whole parameter (a partition group of one rank), DeepSpeed fetches it
by copying its host partition to the GPU on the fetch coordinator's copy stream (its "no-gather" handles),
and waiting for the fetch synchronizes the host with that stream. The coordinator then makes the compute
stream wait for the copy stream anyway, so that host wait only keeps the host from queueing the module's
kernels and the next prefetch until the copy has landed: the GPU runs dry between modules and copies and
compute take turns. Profiled at 1.65B with accumulation 8 on an H200: 712 ms a step in stream
synchronizes, 469 ms with nothing on the GPU (benchmarks/results/2026-11-27-h200-offload-profile/).

Here the wait only marks the parameters available; the copy stream orders everything else. It is safe
because every reader of such a parameter runs on a stream ordered after the copy: the coordinator's
compute stream (it waits for the copy stream before the module runs), fetches outside the coordinator
(they copy on the stream that reads), and the allocator, which reuses a freed copy's memory on the copy
stream after it or on the compute stream after the module (free_param records that stream). The host
still runs at most a few fetches ahead: the coordinator's own back-pressure waits on an event of the
fetch two before. Only streams change: the values are DeepSpeed's.
"""

from __future__ import annotations


def applies(engine) -> str | None:
    """Why the host-free wait does not cover `engine` (None: it does): it needs ZeRO-3 with the parameters
    offloaded, on CUDA, with each parameter's partition the whole of it (one rank per partition group)."""
    import torch
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero import partition_parameters as pp

    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    if type(getattr(engine, "optimizer", None)) is not DeepSpeedZeroOptimizer_Stage3:
        return "not ZeRO-3's own optimizer"
    offload = getattr(engine, "zero_offload_param", lambda: None)()
    if offload is None or str(getattr(offload, "device", "none")).lower().endswith("none"):
        return "parameters not offloaded"
    if get_accelerator().device_name() != "cuda" or not torch.cuda.is_available():
        return "not a CUDA accelerator"
    partitioned = [p for p in engine.module.parameters() if hasattr(p, "ds_zero_partition_world_size")]
    if not partitioned or any(p.ds_zero_partition_world_size != 1 for p in partitioned):
        return "partitions spread over several ranks (DeepSpeed's gather path)"
    for name in ("NoGatherHandle", "NoGatherCoalescedHandle"):
        if not hasattr(getattr(pp, name, None), "wait"):
            return f"this DeepSpeed has no {name}"
    return None


def install(engine=None, state=None) -> None:
    """Replace the two no-gather handles' waits (process-wide: the handles are DeepSpeed's classes)."""
    from deepspeed.runtime.zero import partition_parameters as pp

    pp.NoGatherHandle.wait = _wait_one
    pp.NoGatherCoalescedHandle.wait = _wait_many


def _wait_one(self, **kwargs) -> None:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    if self._NoGatherHandle__complete:
        return
    self._NoGatherHandle__param.ds_status = ZeroParamStatus.AVAILABLE
    self._NoGatherHandle__complete = True


def _wait_many(self, **kwargs) -> None:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    if self._NoGatherCoalescedHandle__complete:
        return
    for param in self._NoGatherCoalescedHandle__params:
        if param.ds_status != ZeroParamStatus.INFLIGHT:
            raise RuntimeError(f"expected param {param.ds_summary()} to be inflight")
        param.ds_status = ZeroParamStatus.AVAILABLE
    self._NoGatherCoalescedHandle__complete = True
