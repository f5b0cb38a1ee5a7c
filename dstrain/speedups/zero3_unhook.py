"""ZeRO-3 without offload: no module hooks on modules whose parameters are all persistent (registry:
zero3_hooks; needs zero3_step).

DeepSpeed hooks every partitioned module to fetch and release its parameters around its forward and
backward. A persistent parameter is never released between steps, so for a module whose parameters are
all persistent those hooks do nothing but cost host time. They are removed before the first forward;
one pre-forward hook on the model gathers any of their parameters found partitioned (after a checkpoint
load). The losses are the same to the bit (tests/test_zero3_step.py).
"""

from __future__ import annotations


def applies(engine) -> str | None:
    """Why `engine`'s module hooks cannot be taken off here (None: they can)."""
    offload = getattr(getattr(engine, "optimizer", None), "parameter_offload", None)
    if offload is None or not all(hasattr(offload, name) for name in ("forward_hooks", "backward_hooks", "module")):
        return "no DeepSpeed ZeRO-3 parameter offload object with its hooks"
    return None


def install(engine, state) -> str | None:
    """Remove DeepSpeed's module hooks from `engine`'s modules whose parameters are all persistent, and
    guard their parameters with one pre-forward hook on the model; why not where no module qualifies."""
    from deepspeed.runtime.zero.partitioned_param_coordinator import iter_params
    from deepspeed.utils import z3_leaf_module

    offload = engine.optimizer.parameter_offload
    root = offload.module
    unhooked, guarded = [], []
    for module in root.modules():
        if module is root or not hasattr(module, "ds_id"):  # not one DeepSpeed registered
            continue
        params = list(iter_params(module, recurse=z3_leaf_module(module)))
        if params and all(getattr(p, "ds_persist", False) for p in params):
            unhooked.append(module)
            guarded += params
    if not unhooked:
        return "no module has all its parameters persistent"
    dicts = {id(d) for m in unhooked for d in (m._forward_pre_hooks, m._forward_hooks)}
    for hooks in (offload.forward_hooks, offload.backward_hooks):
        kept = []
        for handle in hooks:
            if id(handle.hooks_dict_ref()) in dicts:
                handle.remove()
            else:
                kept.append(handle)
        hooks[:] = kept
    guarded = list({id(p): p for p in guarded}.values())
    root.register_forward_pre_hook(lambda _module, _args: gather_missing(guarded), prepend=True)
    state.unhooked = len(unhooked)
    return None


def gather_missing(params) -> None:
    """Gather those of `params` that are partitioned, in one coalesced all-gather."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    missing = [p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
    if missing:
        missing[0].all_gather_coalesced(missing).wait()
