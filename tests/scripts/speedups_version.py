"""tests/test_speedups.py's rank: builds and trains the tiny MLP under ZeRO-3 through the registry, once as
if the installed DeepSpeed were 0.18.0 (outside the verified versions) and once as it is, and reports what
was applied, what rank 0 would say, whether the optimizer kept DeepSpeed's own methods and which
`stage3.defragment` was in place while the engine was built."""

from __future__ import annotations

import deepspeed
import torch
from deepspeed.runtime.zero import stage3

from dstrain import speedups
from scripts.rank_setup import parameters, result, start_rank
from scripts.tiny_mlp import tiny_mlp, train_tiny_mlp

CONFIG = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}


def build(version: str | None, device: str) -> dict:
    defragment = []
    with speedups.building_engine(deepspeed_version=version):
        defragment.append(stage3.defragment.__module__)
        engine, *_ = deepspeed.initialize(model=tiny_mlp(), config=CONFIG)
    report = speedups.apply(engine, deepspeed_version=version)
    optimizer = engine.optimizer
    stock = all(getattr(getattr(optimizer, name), "__func__", None) is getattr(type(optimizer), name)
                for name in ("step", "partition_grads"))
    return {"applied": report.applied, "lines": report.lines(), "not_applied": sorted(report.not_applied),
            "stock": stock, "defragment": defragment[0], "norms": train_tiny_mlp(engine, 3, torch.float32, device)}


def main(params: dict) -> None:
    device = start_rank(params)
    result({"old": build("0.18.0", device), "verified": build(None, device)})


if __name__ == "__main__":
    main(parameters())
