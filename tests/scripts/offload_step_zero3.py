"""tests/test_offload_step_zero3.py's rank: trains the tiny MLP with ZeRO-3 CPU offload, with DeepSpeed's
own step and with each of params["variants"] of dstrain's (the chunked step and direct gradient copies,
the bf16 rounding on the GPU, the step overlapped with the next forward; with accumulate: the sums
kept on the device, alone or with the overlap), for each case in
params["cases"] (precision, accumulation, clip, parameter offload, overflow micro-step, accumulation
dtype); params["persist"] is the persistence threshold. params["groups"], where given: several named
[cases, variants, persist] groups in one start-up instead, the results by group name."""

from __future__ import annotations

import time

import deepspeed
import torch

from dstrain.config.schema import SpeedupsConfig
from dstrain.speedups import apply, state_of
from scripts.rank_setup import parameters, result, start_rank
from scripts.tiny_mlp import tiny_mlp, train_tiny_mlp

CHANGES = ("offload_chunks_zero3", "offload_grads_zero3", "offload_bf16_grads_zero3")


class SlowAdam:
    """DeepSpeed's CPU Adam op, each call 3 ms late: the overlapped step is still running when the next
    forward gathers its first parameters, so the test sees the waits do their work."""

    def __init__(self, op):
        self.op = op

    def adam_update(self, *args):
        time.sleep(0.003)
        return self.op.adam_update(*args)

    def adam_update_tiles(self, *args):
        time.sleep(0.003)
        return self.op.adam_update_tiles(*args)

    def __getattr__(self, name):
        return getattr(self.op, name)


def train(device, persist, precision, accum, clip, offload_param, variant, overflow_at=None, accum_dtype=None):
    model = tiny_mlp()  # 6,337 parameters
    pin = device == "cuda"
    zero = {"stage": 3, "sub_group_size": 4000,  # two sub-groups: 4,224 and 2,113 elements
            # persist 100: the biases and the last layer's weight stay gathered between steps
            "stage3_param_persistence_threshold": persist,
            "offload_optimizer": {"device": "cpu", "pin_memory": pin}}
    if offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": accum,
              "gradient_clipping": clip, "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}}
    if precision == "bf16":
        config["bf16"] = {"enabled": True, "check_grad_overflow": overflow_at is not None}
    if accum_dtype:
        config["data_types"] = {"grad_accum_dtype": accum_dtype}
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    # chunks of 1,024: each sub-group in several, the last one short
    applied = accumulated = None
    if variant != "deepspeed":  # gpu_rounding: the bf16 rounding off the Adam pass, on the GPU if any
        # *_accumulate: the sums kept on the device, forced on (auto leaves them off on a CPU accelerator)
        accumulate = variant.endswith("accumulate")
        settings = SpeedupsConfig(offload_chunk_elements=1024, offload_host_rounding=variant != "gpu_rounding",
                                  offload_accumulate=accumulate)
        report = apply(engine, settings, only=CHANGES + ("offload_host_rounding",)
                       + (("offload_accumulate_zero3",) if accumulate else ()))
        applied = [name in report.applied for name in CHANGES]
        if accumulate:
            accumulated = "offload_accumulate_zero3" in report.applied or report.not_applied["offload_accumulate_zero3"]
    if variant.startswith("overlap"):
        applied.append("offload_overlap" in apply(engine, settings, only=("offload_overlap",)).applied)
        state_of(engine).overlap.adam_op = SlowAdam(state_of(engine).overlap.adam_op)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    norms = train_tiny_mlp(engine, 4 * accum, dtype, device, overflow_at)
    optimizer = engine.optimizer
    overlap = getattr(state_of(engine), "overlap", None)
    if overlap is not None:
        overlap.drain()  # the last step's update: read below
    masters = torch.cat([m.detach().flatten() for m in optimizer.fp32_partitioned_groups_flat]).tolist()
    bit16 = torch.cat([f.detach().float().flatten().cpu() for f in optimizer.fp16_partitioned_groups_flat]).tolist()
    return {"applied": applied, "accumulated": accumulated, "norms": norms, "masters": masters, "bit16": bit16,
            "sub_groups": len(optimizer.fp16_groups), "skipped": engine.skipped_steps,
            # DeepSpeed's host copy of the gradient partitions: the direct copy leaves it unwritten
            "host_buffer_written": bool(optimizer.grad_partitions_flat_buffer.abs().sum() > 0),
            "pinned": all(m.is_pinned() for m in optimizer.fp32_partitioned_groups_flat),
            "rounded_by_adam": getattr(state_of(engine), "round_op", None) is not None,
            "persistent": len(optimizer.persistent_parameters),
            "overlapped_steps": overlap.steps if overlap else None, "waits": overlap.waits if overlap else None}


def train_cases(device, cases, variants, persist) -> dict:
    """Each case trained by DeepSpeed's step and by each of `variants`, by the case's key."""
    out = {}
    for precision, accum, clip, offload_param, overflow_at, accum_dtype in cases:
        key = f"{precision}-{accum}-clip{clip}" + ("-offload_param" if offload_param else "") + (
            "-overflow" if overflow_at is not None else "") + (f"-accum_{accum_dtype}" if accum_dtype else "")
        out[key] = {name: train(device, persist, precision, accum, clip, offload_param, name, overflow_at,
                                accum_dtype)
                    for name in ("deepspeed", *variants)}
    return out


def main(params: dict) -> None:
    device = start_rank(params)
    if "groups" in params:
        result({name: train_cases(device, cases, variants, persist)
                for name, (cases, variants, persist) in params["groups"].items()})
    else:
        result(train_cases(device, params["cases"], params["variants"], params["persist"]))


if __name__ == "__main__":
    main(parameters())
