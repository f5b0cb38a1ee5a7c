"""dstrain's changes to DeepSpeed's ZeRO-3 without offload, installed together (as rank/offload.py does for
CPU offload): the step (zero3_step.py), no module hooks where every parameter stays whole (zero3_hooks.py)
and the lean backward (zero3_grads.py), each with its DSTRAIN_* switch, and the line rank 0 prints."""

from __future__ import annotations

from dstrain.rank.zero3_grads import lean_zero3_grads
from dstrain.rank.zero3_hooks import unhook_persistent_modules
from dstrain.rank.zero3_step import lean_zero3_step
from dstrain.switches import switched_off


def speed_up_zero3(engine, env) -> tuple[bool, int, bool]:
    """dstrain's ZeRO-3 changes without offload, each unless its DSTRAIN_* switch is off: the step
    (DSTRAIN_ZERO3_STEP; its gather on several ranks, DSTRAIN_ZERO3_GATHER), no hooks on whole modules
    (zero3_hooks.py, DSTRAIN_ZERO3_HOOKS) and the lean backward (zero3_grads.py, DSTRAIN_ZERO3_GRADS),
    the latter three only with the step. Returns (step installed, modules unhooked, lean backward
    installed)."""
    if switched_off(env, "DSTRAIN_ZERO3_STEP") or not lean_zero3_step(engine):
        return False, 0, False
    # several ranks: the persistent parameters' gather regrouped in one copy (DSTRAIN_ZERO3_GATHER=off:
    # by DeepSpeed's coalesced handle, a parameter at a time)
    engine.optimizer._dstrain_lean_gather = not switched_off(env, "DSTRAIN_ZERO3_GATHER")
    unhooked = 0 if switched_off(env, "DSTRAIN_ZERO3_HOOKS") else unhook_persistent_modules(engine)
    lean_grads = not switched_off(env, "DSTRAIN_ZERO3_GRADS") and lean_zero3_grads(engine)
    return True, unhooked, lean_grads


def describe_lean_step(unhooked: int, lean_grads: bool = False) -> str:
    """The line rank 0 prints when lean_zero3_step applied (and zero3_hooks.py took the hooks off
    `unhooked` modules, zero3_grads.py made the backward's gradient copies lean), with the switches."""
    line = ("ZeRO-3: the step's release, gradient norm and persistent gather batched "
            "(DSTRAIN_ZERO3_STEP=off: DeepSpeed's step)")
    if lean_grads:
        line += "; the backward's gradient copies lean (DSTRAIN_ZERO3_GRADS=off: DeepSpeed's)"
    if unhooked:
        line += (f"; no module hooks on {unhooked} modules whose parameters stay gathered "
                 "(DSTRAIN_ZERO3_HOOKS=off: kept)")
    return line
