"""ZeRO-3 without offload: no module hooks on modules whose parameters are all persistent
(DeepSpeed 0.19's DeepSpeedZeRoOffload).

DeepSpeed hooks every module it partitions: before and after its forward, and through autograd
functions on its inputs and outputs before and after its backward, each hook fetching or releasing the
module's parameters and recording the module's place in the trace it prefetches by. A persistent
parameter (under stage3_param_persistence_threshold: a small GPT's blocks, finding 30) is never released
between steps, so for a module whose parameters are all persistent the hooks fetch and release nothing;
on the 406M GPT they are 26 of the 31 hooked modules (the blocks, the position embedding, the last
layer norm), and their hooks were most of the forward's host time (finding 37). Here they are removed
before the first forward, so the trace never holds those modules. One forward pre-hook on the model
stands guard instead: any of their parameters not gathered when a forward starts (after a
checkpoint is loaded, DeepSpeed partitions the persistent parameters and gathers them again later)
is gathered there, in one coalesced all-gather.

Only with dstrain's ZeRO-3 step (zero3_step.py: no offload, whose step beside the next forward relies on
the fetch hooks to wait for its weights) and before any forward; the losses are the same to the bit
(tests/test_zero3_step.py).
"""

from __future__ import annotations


def unhook_persistent_modules(engine) -> int:
    """Remove DeepSpeed's module hooks from `engine`'s modules whose parameters are all persistent, and
    guard their parameters with one pre-forward hook on the model; how many modules lost their hooks
    (0: nothing changed)."""
    from deepspeed.runtime.zero.partitioned_param_coordinator import iter_params
    from deepspeed.utils import z3_leaf_module

    from dstrain.rank.zero3_step import has_lean_step

    optimizer = getattr(engine, "optimizer", None)
    offload = getattr(optimizer, "parameter_offload", None)
    if (not has_lean_step(optimizer) or offload is None
            or not all(hasattr(offload, name) for name in ("forward_hooks", "backward_hooks", "module"))):
        return 0
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
        return 0
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
    return len(unhooked)


def gather_missing(params) -> None:
    """Gather those of `params` that are partitioned, in one coalesced all-gather."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    missing = [p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
    if missing:
        missing[0].all_gather_coalesced(missing).wait()
