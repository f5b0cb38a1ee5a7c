"""dstrain's changes to DeepSpeed's CPU-offload optimizers, applied to a built engine: ZeRO-1/2 without
per-parameter GPU waits (offload_syncs.py), and the optimizer step in chunks with the bf16 rounding on the
GPU (offload_step.py for ZeRO-1/2, offload_step_zero3.py for ZeRO-3). Each leaves an engine it does not
cover as it is."""

from __future__ import annotations

from dstrain.rank.offload_step import DEFAULT_CHUNK_ELEMENTS, chunk_offload_step
from dstrain.rank.offload_step_zero3 import chunk_zero3_offload_step
from dstrain.rank.offload_syncs import remove_offload_syncs


def speed_up_offload(engine, env) -> tuple[bool, bool]:
    """Apply what covers `engine` (the chunked steps unless DSTRAIN_OFFLOAD_CHUNKS is off); what applied:
    (ZeRO-1/2 without per-parameter waits, a chunked step)."""
    chunk = chunk_elements_from_env(env)
    return remove_offload_syncs(engine), chunk_offload_step(engine, chunk) or chunk_zero3_offload_step(engine, chunk)


def chunk_elements_from_env(env) -> int:
    """DSTRAIN_OFFLOAD_CHUNKS: off (0/off/false/no: DeepSpeed's own step), a number of elements per chunk
    (for tuning), or unset for the default."""
    value = env.get("DSTRAIN_OFFLOAD_CHUNKS", "").strip().lower()
    if value in ("0", "off", "false", "no"):  # as every DSTRAIN_* switch reads
        return 0
    return int(value) if value.isdigit() else DEFAULT_CHUNK_ELEMENTS
