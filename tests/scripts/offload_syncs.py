"""tests/test_offload_syncs.py's rank: trains the tiny MLP with ZeRO-1/2 CPU offload, with DeepSpeed's own
optimizer and with dstrain's patches (no per-parameter syncs; the step in chunks; bf16 gradients to the
host; where it applies, the accumulated gradients kept on the device), for each case in params["cases"]
(stage, precision, accumulation, clip, overflow micro-step); and for each of params["accumulate_cases"]
(the same, and whether to compose), with DeepSpeed's own accumulation and with the sums kept on the
device, alone and (composed) beside the other patches."""

from __future__ import annotations

import deepspeed
import torch

from dstrain.config.schema import SpeedupsConfig
from dstrain.speedups import apply, state_of
from scripts.rank_setup import parameters, result, start_rank
from scripts.tiny_mlp import tiny_mlp, train_tiny_mlp

PATCHES = (("deepspeed", ()), ("syncs", ("syncs",)), ("dstrain", ("syncs", "chunks", "accumulate")),
           ("bf16", ("syncs", "bf16")))
ACCUMULATE_PATCHES = (("deepspeed", ()), ("accumulate", ("accumulate",)))
COMPOSED_PATCHES = (("bf16", ("syncs", "bf16")), ("all", ("syncs", "bf16", "accumulate")))


def accumulate_on_device(engine) -> dict:
    """speedups.offload_accumulate forced on (true): whether its ZeRO-1/2 entry applied, and why not."""
    report = apply(engine, SpeedupsConfig(offload_accumulate=True), only=("offload_accumulate_zero12",))
    return {"applied": "offload_accumulate_zero12" in report.applied,
            "reason": report.not_applied.get("offload_accumulate_zero12")}


def train(device, stage, precision, accum, clip, patches, overflow_at=None):
    model = tiny_mlp()
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": accum,
              "gradient_clipping": clip,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
              "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": device == "cuda"}}}
    if precision == "bf16":  # as dstrain renders bf16, or with the overflow check on
        config["bf16"] = {"enabled": True, "check_grad_overflow": overflow_at is not None}
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    applied = {}
    if "syncs" in patches:
        applied["syncs"] = "offload_syncs" in apply(engine, only=("offload_syncs",)).applied
    if "chunks" in patches:  # chunks of 1,024: the 6,337 weights in seven, the last one short
        settings = SpeedupsConfig(offload_chunk_elements=1024)
        applied["chunks"] = "offload_chunks" in apply(engine, settings, only=("offload_chunks",)).applied
    if "bf16" in patches:  # chunks of 4,096 in tiles of 1,024: two chunks, the last chunk and tile short
        settings = SpeedupsConfig(offload_chunk_elements=4096)
        done = apply(engine, settings, only=("offload_chunks", "offload_bf16_grads")).applied
        applied["chunks"], applied["bf16"] = "offload_chunks" in done, "offload_bf16_grads" in done
        if applied["bf16"]:
            state_of(engine).bf16_grads = (state_of(engine).bf16_grads[0], 1024)
    if "accumulate" in patches:
        accumulate = accumulate_on_device(engine)
        applied["accumulate"] = accumulate["applied"] or accumulate["reason"]
    tracker = engine.optimizer.update_offload_overflow_tracker
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    norms = train_tiny_mlp(engine, 4 * accum, dtype, device, overflow_at)
    weights = torch.cat([p.detach().float().flatten() for p in engine.module.parameters()]).tolist()
    masters = torch.cat([m.detach().flatten() for m in engine.optimizer.single_partition_of_fp32_groups]).tolist()
    return {"applied": applied, "tracker_patched": getattr(tracker, "__name__", "") == "_no_overflow_tracking",
            "norms": norms, "weights": weights, "skipped": engine.skipped_steps,
            "masters": masters,
            "pinned": engine.optimizer.single_partition_of_fp32_groups[0].is_pinned()}


def main(params: dict) -> None:
    device = start_rank(params)
    out = {}
    # A clip of 0.05 is below every norm here (each step clips, with the norm computed); 100 is above
    # them (the unscale factor is 1: no multiply).
    for stage, precision, accum, clip, overflow_at in params["cases"]:
        key = f"{stage}-{precision}-{accum}-clip{clip}" + ("-overflow" if overflow_at is not None else "")
        out[key] = {name: train(device, stage, precision, accum, clip, patches, overflow_at) for name, patches in PATCHES}
    for stage, precision, accum, clip, overflow_at, composed in params.get("accumulate_cases", ()):
        key = f"accumulate-{stage}-{precision}-{accum}-clip{clip}" + ("-overflow" if overflow_at is not None else "")
        out[key] = {name: train(device, stage, precision, accum, clip, patches, overflow_at)
                    for name, patches in ACCUMULATE_PATCHES + (COMPOSED_PATCHES if composed else ())}
    result(out)


if __name__ == "__main__":
    main(parameters())
