"""ZeRO-3 with the parameters offloaded and gradient accumulation: the weights fetched at a window's first
micro step stay on the GPU until its last (registry: offload_keep_weights).

DeepSpeed releases each module's gathered weights after the module has run (in the forward beyond
`stage3_max_reuse_distance`, and in the backward), so every micro step fetches the whole model from host
memory again, though nothing changes the weights between an accumulation window's micro steps: only the
optimizer step at its end does. Profiled at 1.65B with accumulation 8 on an H200, those fetches are
36.6 GB a step over PCIe, with the GPU idle for 1,100 ms of a 2,000 ms step while the hooks fetch
(benchmarks/results/2026-11-27-h200-offload-profile/, call 3); wider prefetch settings did not help
(2026-11-27-h200-offload-prefetch/). Kept, the step moves 3.3 GB and runs 12-13% faster (-keep/, -host/).

Here the coordinator's release is skipped while the engine trains and the micro step is not the window's
last: the weights stay gathered, so the later micro steps fetch nothing. At the last micro step
DeepSpeed's releases run as before, so the step (which releases everything before it updates the host
partitions) and everything after it see DeepSpeed's state. A kept weight is the same bf16 copy of the
same host partition a fetch would make: the values are DeepSpeed's. The price is GPU memory: the whole
model's gathered weights between micro steps (`kept_bytes`).
"""

from __future__ import annotations

from dstrain.speedups.offload_accumulate_zero12 import auto_refusal

_COORDINATOR = "_PartitionedParameterCoordinator"
_UNCOUNTED = "dstrain_kept_uncounted"  # on a kept weight taken out of the coordinator's count of gathered ones


def _coordinator(engine):
    offload = getattr(engine.optimizer, "parameter_offload", None)
    return None if offload is None else offload.get_param_coordinator()


def applies(engine) -> str | None:
    """Why keeping the weights does not cover `engine` (None: it does): it needs ZeRO-3's own optimizer with
    the parameters offloaded to the CPU, gradient accumulation, and DeepSpeed's release path (not the leaf-module
    fast sharding of zero_module_granularity_threshold, which swaps a released weight's data itself)."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    if type(getattr(engine, "optimizer", None)) is not DeepSpeedZeroOptimizer_Stage3:
        return "not ZeRO-3's own optimizer"
    offload = getattr(engine, "zero_offload_param", lambda: None)()
    device = str(getattr(offload, "device", "none")).lower()
    if offload is None or device.endswith("none"):
        return "parameters not offloaded"
    if not device.endswith("cpu"):  # NVMe: its swap-in prefetcher follows DeepSpeed's release order
        return "parameters offloaded to NVMe"
    if engine.gradient_accumulation_steps() <= 1:
        return "no gradient accumulation"  # registry.NO_ACCUMULATION: rank 0 says nothing of it
    coordinator = _coordinator(engine)
    needed = (f"{_COORDINATOR}__release_param", "release_and_reset_all", f"{_COORDINATOR}__n_available_params")
    if coordinator is None or not all(hasattr(coordinator, name) for name in needed):
        return "this DeepSpeed's parameter coordinator differs"
    if getattr(coordinator, "fast_sharding_for_leaf_module", False):
        return "zero_module_granularity_threshold's fast leaf-module sharding"
    return None


def kept_bytes(engine) -> int:
    """GPU memory the kept weights take at most: every non-persistent parameter, gathered whole, in its dtype
    (persistent ones stay gathered anyway)."""
    return sum(p.ds_numel * p.element_size() for p in engine.module.parameters()
               if hasattr(p, "ds_numel") and not p.ds_persist)


def install(engine, state, auto: bool = False) -> str | None:
    """Skip the coordinator's releases inside an accumulation window; with `auto`, only on a CUDA GPU where
    the kept weights leave a quarter of it free (a reason where not: nothing changed)."""
    import torch
    from deepspeed.accelerator import get_accelerator

    size = kept_bytes(engine)
    if auto:
        reason = auto_refusal(size, torch.device(get_accelerator().current_device_name()))
        if reason is not None:
            return reason
    coordinator = _coordinator(engine)
    release = getattr(coordinator, f"{_COORDINATOR}__release_param")
    release_all = coordinator.release_and_reset_all
    forced = [False]

    def keeping() -> bool:
        return not forced[0] and engine.module.training and not engine.is_gradient_accumulation_boundary()

    counter = f"{_COORDINATOR}__n_available_params"

    def release_param(param, free_data: bool = True) -> None:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        releasable = param.ds_status == ZeroParamStatus.AVAILABLE and not param.ds_active_sub_modules
        if not keeping():
            if releasable and getattr(param, _UNCOUNTED, False):
                # counted back in, as DeepSpeed's release takes it out
                setattr(coordinator, counter, getattr(coordinator, counter) + param.ds_numel)
            setattr(param, _UNCOUNTED, False)
            release(param, free_data)
        elif releasable and not getattr(param, _UNCOUNTED, False):
            # Kept, but no longer counted against stage3_max_live_parameters, once: the prefetcher's budget
            # is what it would be had the weight been released (the whole model is counted by auto's rule).
            setattr(coordinator, counter, getattr(coordinator, counter) - param.ds_numel)
            setattr(param, _UNCOUNTED, True)

    def release_and_reset_all(module) -> None:
        # Everything goes (the step, empty_partition_cache): DeepSpeed checks that it did.
        forced[0] = True
        try:
            release_all(module)
        finally:
            forced[0] = False

    # Instance attributes: the coordinator's name-mangled calls (self.__release_param) find them first.
    setattr(coordinator, f"{_COORDINATOR}__release_param", release_param)
    coordinator.release_and_reset_all = release_and_reset_all
    state.kept_weight_bytes = size
    return None


def describe(state) -> str:
    """Rank 0's words for it."""
    size = state.kept_weight_bytes
    shown = f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"
    return f"weights kept on the GPU between micro steps ({shown})"
