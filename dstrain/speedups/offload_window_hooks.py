"""ZeRO-3 with the weights kept through an accumulation window: no module hooks after the window's first
micro step (registry: offload_window_hooks; needs offload_keep_weights).

With the weights kept (offload_keep_weights.py), a window's later micro steps find every weight gathered,
yet DeepSpeed's hooks still run around each module's forward and backward: the coordinator's fetch and
trace bookkeeping, two autograd Functions wrapped around every module's inputs and outputs, and the
releases that keeping skips. That is host time in every micro step (py-spy at 1.65B, accumulation 8: the
training thread's forward ran about 100 ms a micro step against the GPU's 60; results/
2026-11-27-h200-offload-host/, call 6). Here one pre-forward hook on the model decides, at each training
forward, whether the hooks run: not after the window's first micro step while every weight is gathered.
The coordinator then sees only the windows' first micro steps, as it would at accumulation 1, and the
step's release of everything (before it updates the host partitions) releases what the last micro
step's backward would have. An evaluation forward, or a weight found partitioned, runs the hooks as
DeepSpeed does. Losses and weights are DeepSpeed's bit for bit (tests/test_offload_keep_weights.py).
"""

from __future__ import annotations


def applies(engine) -> str | None:
    """Why the hooks cannot be skipped inside a window here (None: they can)."""
    offload = getattr(getattr(engine, "optimizer", None), "parameter_offload", None)
    if offload is None or not all(hasattr(offload, name) for name in ("forward_hooks", "backward_hooks",
                                                                       "fwd_pre_hook", "module")):
        return "this DeepSpeed's ZeRO-3 module hooks differ"
    return None


def install(engine, state) -> None:
    """Wrap each of DeepSpeed's module hooks in a check of one flag, set by a pre-forward hook on the model."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    offload = engine.optimizer.parameter_offload
    root = offload.module
    weights = [p for p in root.parameters() if hasattr(p, "ds_id")]
    window = engine.gradient_accumulation_steps()
    skipping = [False]

    def decide(module, _args) -> None:
        # micro_steps counts engine.step() calls: 0 at a window's first micro step
        skipping[0] = (module.training and engine.micro_steps % window != 0
                       and all(p.ds_status == ZeroParamStatus.AVAILABLE for p in weights))
        state.skipped_forwards += skipping[0]

    def skippable(hook):
        def run_unless_skipping(*args):
            return None if skipping[0] else hook(*args)
        return run_unless_skipping

    handles = [*offload.forward_hooks, *offload.backward_hooks, offload.fwd_pre_hook]
    for handle in handles:
        hooks = handle.hooks_dict_ref()
        if hooks is not None and handle.id in hooks:
            hooks[handle.id] = skippable(hooks[handle.id])  # same id: the hook keeps its place and flags
    # first among the model's pre-forward hooks, before DeepSpeed's start-of-forward reset
    root.register_forward_pre_hook(decide, prepend=True)
    state.window_hooks = len(handles)
