"""tests/test_zero3_step.py's rank: trains the tiny MLP with DeepSpeed's ZeRO-3 step, with dstrain's lean
step and with the last layer unhooked, for each case in params["cases"] (precision, accumulation, clip,
overflow micro-step, reduce bucket), and reports weights, norms, gathers and parameter states."""

from __future__ import annotations

import os
import tempfile

import deepspeed
import torch
import torch.distributed
from deepspeed.comm import comm as ds_comm
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from dstrain.speedups import apply, state_of
from dstrain.speedups.zero3_step import release_all_parameters
from scripts.rank_setup import parameters, result, start_rank
from scripts.tiny_mlp import tiny_mlp, train_tiny_mlp

STEP = ("zero3_step", "zero3_gather")  # the batched step, its gather regrouped as the worker has it
gathers = {"count": 0}


def counted_all_gather(*args, **kwargs):  # DeepSpeed's backend: every all-gather of its comm goes here
    gathers["count"] += 1
    return type(ds_comm.cdb).all_gather_into_tensor(ds_comm.cdb, *args, **kwargs)


def real_elements(optimizer, flats):
    # each sub-group's flat partition without the padding of the parameters' last partitions, which
    # holds whatever its memory held (DeepSpeed's own runs differ from each other there)
    rank, values = torch.distributed.get_rank(), []
    for params, flat in zip(optimizer.fp16_groups, flats):
        offset = 0
        for p in params:
            size = p.ds_tensor.ds_numel
            real = min(size, max(0, p.ds_numel - rank * size))
            values += flat.detach().float().cpu()[offset:offset + real].tolist()
            offset += size
    return values


def train(device, checkpoints, precision, accum, clip, overflow_at, bucket, variant, offload=False):
    model = tiny_mlp()  # 6,337 parameters
    zero = {"stage": 3, "sub_group_size": 4000,  # two sub-groups
            # the biases and the last layer's weight stay gathered between steps
            "stage3_param_persistence_threshold": 100}
    if bucket:  # the reduce bucket fills in the backward; a weight larger than it is reduced where it is
        zero["reduce_bucket_size"] = bucket
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": accum,
              "gradient_clipping": clip, "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}}
    if precision == "bf16":
        config["bf16"] = {"enabled": True, "check_grad_overflow": overflow_at is not None}
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    applied = "zero3_step" in apply(engine, only=STEP).applied if variant != "deepspeed" else None
    if variant != "deepspeed":
        apply(engine, only=("zero3_grads",))  # nothing without the lean step (offload)
    lean = {"zero3_step", "zero3_grads"} <= set(getattr(state_of(engine), "applied", []))
    unhooked = 0  # 0 without the lean step
    if variant == "unhooked" and "zero3_hooks" in apply(engine, only=("zero3_hooks",)).applied:
        unhooked = state_of(engine).unhooked
    if offload:
        return {"applied": applied, "unhooked": unhooked}
    # count the all-gathers of the steps (the persistent parameters' gather after each update)
    step = engine.optimizer.step

    def counting_step(*args, **kwargs):
        ds_comm.cdb.all_gather_into_tensor = counted_all_gather
        try:
            return step(*args, **kwargs)
        finally:
            del ds_comm.cdb.all_gather_into_tensor
    engine.optimizer.step = counting_step
    gathers["count"] = 0
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    norms = train_tiny_mlp(engine, 4 * accum, dtype, device, overflow_at)
    optimizer = engine.optimizer
    persistent = set(map(id, optimizer.persistent_parameters))
    params = list(model.parameters())
    loss = None
    if variant == "unhooked" and int(os.environ["WORLD_SIZE"]) == 1:
        probe = torch.randn(4, 32, generator=torch.Generator().manual_seed(2)).to(device=device, dtype=dtype)
        loss = float(engine(probe).float().pow(2).mean())
        # every parameter released, as at the start of a step: the model's guard gathers the unhooked
        # layer's parameters at the next forward (its data is empty until then)
        release_all_parameters(engine.optimizer)
        assert engine.module[4].weight.numel() == 0
        assert float(engine(probe).float().pow(2).mean()) == loss
        # a checkpoint loaded into a fresh engine (DeepSpeed partitions the persistent parameters on
        # load and gathers them again): the unhooked layer computes with the loaded weights
        tag = key_of(precision, accum, clip, overflow_at, bucket)
        engine.save_checkpoint(checkpoints, tag=tag)
        fresh, *_ = deepspeed.initialize(model=tiny_mlp(), config=config)
        apply(fresh, only=STEP + ("zero3_hooks", "zero3_grads"))
        fresh.load_checkpoint(checkpoints, tag=tag)
        loss = [loss, float(fresh(probe).float().pow(2).mean())]
    views = getattr(state_of(engine), "grad_views", 0) if variant != "deepspeed" else 0
    return {"applied": applied, "lean": lean, "norms": norms, "unhooked": unhooked, "reloaded_loss": loss,
            "grad_views": views, "sub_groups": len(engine.optimizer.fp16_groups),
            "masters": real_elements(optimizer, optimizer.fp32_partitioned_groups_flat),
            "bit16": real_elements(optimizer, optimizer.fp16_partitioned_groups_flat),
            "skipped": engine.skipped_steps, "persistent": len(persistent), "gathers": gathers["count"],
            # between steps: the persistent parameters gathered and current, the others released
            "statuses_right": all(p.ds_status == (ZeroParamStatus.AVAILABLE if id(p) in persistent
                                                  else ZeroParamStatus.NOT_AVAILABLE) for p in params),
            # a list, not a generator: every rank gathers every parameter, whatever it finds
            "persistent_current": all([torch.equal(p.data.flatten().cpu(), whole(p))
                                       for p in params if id(p) in persistent])}


def whole(param):
    # the parameter as every rank's partition makes it, gathered here apart from the step
    shares = [torch.empty_like(param.ds_tensor) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(shares, param.ds_tensor)
    return torch.cat(shares)[:param.numel()].cpu()


def key_of(precision, accum, clip, overflow_at, bucket):
    return (f"{precision}-{accum}-clip{clip}" + (f"-bucket{bucket}" if bucket else "")
            + ("-overflow" if overflow_at is not None else ""))


def main(params: dict) -> None:
    device = start_rank(params)
    checkpoints = tempfile.mkdtemp()
    out = {}
    for case in params["cases"]:
        out[key_of(*case)] = {name: train(device, checkpoints, *case, name) for name in ("deepspeed", "lean", "unhooked")}
    out["offload"] = train(device, checkpoints, "bf16", 1, 0.0, None, None, "unhooked", offload=True)
    result(out)


if __name__ == "__main__":
    main(parameters())
