"""dstrain's changes to DeepSpeed's CPU-offload optimizers, applied to a built engine: ZeRO-1/2 without
per-parameter GPU waits (offload_syncs.py), ZeRO-3's gradients copied to the host once
(offload_grads_zero3.py), the optimizer step in chunks with the bf16 rounding on the GPU, or for ZeRO-3
with parameter offload in the Adam pass itself (offload_step.py for ZeRO-1/2, offload_step_zero3.py for
ZeRO-3), the gradients sent to the host in
bf16 (offload_step.py; ZeRO-3's direct copy, offload_grads_zero3.py), and ZeRO-3's step run beside the
next forward (offload_overlap_zero3.py). Each leaves an engine it does not cover as it is."""

from __future__ import annotations

from dstrain.rank.offload_grads_zero3 import bf16_zero3_offload_grads, direct_zero3_offload_grads
from dstrain.rank.offload_overlap_zero3 import overlap_zero3_offload_step
from dstrain.rank.offload_step import DEFAULT_CHUNK_ELEMENTS, bf16_offload_grads, chunk_offload_step
from dstrain.rank.offload_step_zero3 import chunk_zero3_offload_step
from dstrain.rank.offload_syncs import remove_offload_syncs
from dstrain.switches import number_or_switch, switched_off


def speed_up_offload(engine, env) -> dict[str, bool]:
    """Apply what covers `engine`; which changes applied. DSTRAIN_OFFLOAD_CHUNKS=off keeps DeepSpeed's
    step, DSTRAIN_OFFLOAD_GRADS=off its gradient copies (ZeRO-3's, and ZeRO-1/2's widening to fp32 on the
    GPU), DSTRAIN_OFFLOAD_GRADS=fp32 sends them in fp32 (ZeRO-3: dstrain's one copy; ZeRO-1/2: DeepSpeed's
    copies), DSTRAIN_OFFLOAD_OVERLAP=off runs the ZeRO-3 step before the next forward instead of beside it,
    DSTRAIN_OFFLOAD_HOST_ROUNDING=off rounds ZeRO-3's offloaded weights on the GPU instead of in the
    Adam pass, DSTRAIN_OFFLOAD_GIL_HANDOFF=off keeps Python's 5 ms switch interval beside the overlapped
    step (for measuring each change)."""
    chunk = number_or_switch(env, "DSTRAIN_OFFLOAD_CHUNKS", DEFAULT_CHUNK_ELEMENTS)  # elements a chunk
    threads = number_or_switch(env, "DSTRAIN_OFFLOAD_OVERLAP", -1)  # the worker's CPU threads; -1: its default
    grads = gradient_copies(env)
    applied = {"syncs": remove_offload_syncs(engine),
               "grads": grads != "deepspeed" and direct_zero3_offload_grads(engine),
               "chunks": chunk_offload_step(engine, chunk) or chunk_zero3_offload_step(
                   engine, chunk, host_rounding=not switched_off(env, "DSTRAIN_OFFLOAD_HOST_ROUNDING"))}
    applied["host_rounding"] = applied["chunks"] and getattr(engine.optimizer, "_dstrain_round_op", None) is not None
    applied["bf16_grads"] = grads == "bf16" and applied["chunks"] and (  # both need the chunked step
        bf16_offload_grads(engine) or (applied["grads"] and bf16_zero3_offload_grads(engine)))
    applied["overlap"] = threads != 0 and overlap_zero3_offload_step(
        engine, max(threads, 0), quick_gil_handoff=not switched_off(env, "DSTRAIN_OFFLOAD_GIL_HANDOFF"))
    return applied


def gradient_copies(env) -> str:
    """How gradients reach the host, from DSTRAIN_OFFLOAD_GRADS: "bf16" (the default: dstrain's copies, in
    bf16 where the weights are bf16), "fp32" (dstrain's ZeRO-3 copy in fp32, DeepSpeed's ZeRO-1/2 copies;
    for measuring) or "deepspeed" (off: DeepSpeed's copies)."""
    if switched_off(env, "DSTRAIN_OFFLOAD_GRADS"):
        return "deepspeed"
    return "fp32" if (env.get("DSTRAIN_OFFLOAD_GRADS") or "").strip().lower() == "fp32" else "bf16"


def describe(applied: dict[str, bool]) -> str | None:
    """The line rank 0 prints about what speed_up_offload applied (None: nothing), with the switch of each."""
    parts = []
    if applied.get("syncs"):
        parts.append("no per-parameter GPU waits in the backward")
    if applied.get("grads") and applied.get("bf16_grads"):
        parts.append("gradients sent to the host once, in bf16 (DSTRAIN_OFFLOAD_GRADS=off: DeepSpeed's copies)")
    elif applied.get("grads"):
        parts.append("gradients sent to the host once, in fp32 (DSTRAIN_OFFLOAD_GRADS=off: DeepSpeed's copies)")
    elif applied.get("bf16_grads"):
        parts.append("gradients sent to the host in bf16 (DSTRAIN_OFFLOAD_GRADS=off: widened to fp32 on the GPU)")
    if applied.get("chunks"):
        parts.append("optimizer step in chunks (DSTRAIN_OFFLOAD_CHUNKS=off: DeepSpeed's step)")
    if applied.get("host_rounding"):
        parts.append("bf16 weights rounded in the Adam pass (DSTRAIN_OFFLOAD_HOST_ROUNDING=off: on the GPU)")
    if applied.get("overlap"):
        parts.append("the step beside the next forward (DSTRAIN_OFFLOAD_OVERLAP=off: before it)")
    return "CPU offload, dstrain's changes: " + "; ".join(parts) if parts else None
