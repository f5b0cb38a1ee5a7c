"""tests/test_zero3_flatten.py's rank: builds and trains the tiny MLP under ZeRO-3 with DeepSpeed's own
flatten of the parameter partitions and with dstrain's in-place one, and reports the flat buffer, its
views and the training of each."""

from __future__ import annotations

import deepspeed
import torch
from deepspeed.runtime.zero import stage3

from dstrain.speedups import building_engine, zero3_flatten
from scripts.rank_setup import parameters, result, start_rank
from scripts.tiny_mlp import tiny_mlp, train_tiny_mlp


def build_and_train(device: str, ours: bool) -> dict:
    config = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True}, "gradient_clipping": 1.0,
              "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": 3}}
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = tiny_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if ours:
        with building_engine():  # as the ranks build their engines, every change on
            engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    else:
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    buffer = engine.optimizer.lp_param_buffer
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel() * buffer.element_size()
    views = all(start <= p.ds_tensor.data_ptr() < end for p in model.parameters())
    on = str(buffer.device.type)
    flat = [float(x) for x in buffer.float()]
    norms = train_tiny_mlp(engine, 4, torch.bfloat16, device)
    masters = [float(x) for group in engine.optimizer.fp32_partitioned_groups_flat for x in group[:50]]
    return {"flat": flat, "dtype": str(buffer.dtype), "views": views, "device": on, "norms": norms, "masters": masters}


def main(params: dict) -> None:
    device = start_rank(params)
    calls = []
    flatten = zero3_flatten.flatten_on_device  # counted: the test expects one flatten, ours
    zero3_flatten.flatten_on_device = lambda tensors: calls.append(len(tensors)) or flatten(tensors)
    original = stage3.defragment
    theirs = build_and_train(device, False)
    ours = build_and_train(device, True)
    result({"theirs": theirs, "ours": ours, "calls": calls, "restored": stage3.defragment is original})


if __name__ == "__main__":
    main(parameters())
