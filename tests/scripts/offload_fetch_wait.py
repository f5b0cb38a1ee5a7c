"""tests/test_offload_fetch_wait.py's rank: trains a GPT-shaped stack of linear layers with ZeRO-3 and the
parameters offloaded, with DeepSpeed's fetch waits and with dstrain's (offload_fetch_wait), and sends back
the losses, the trained bf16 weights and whether the change applied."""

from __future__ import annotations

import deepspeed
import torch

from dstrain.config.schema import SpeedupsConfig
from dstrain.speedups import apply
from scripts.rank_setup import parameters, result, start_rank
from scripts.tiny_mlp import mlp_stack


def train(device: str, variant: str, steps: int, accum: int) -> dict:
    width = 1024  # wide enough that a copy takes longer than launching the next module's kernels
    model = mlp_stack(width, 6)
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 5_000_000,
            "overlap_comm": True, "offload_param": {"device": "cpu", "pin_memory": True},
            "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": accum, "gradient_clipping": 1.0,
              "zero_optimization": zero, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}}}
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    applied = None
    if variant == "dstrain":
        applied = "offload_fetch_wait" in apply(engine, SpeedupsConfig(), only=("offload_fetch_wait",)).applied
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps * accum):
        x = torch.randn(8, 256, width, generator=generator).to(device=device, dtype=torch.bfloat16)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    weights = torch.cat([p.ds_tensor.detach().float().flatten().cpu() for p in engine.module.parameters()])
    return {"applied": applied, "losses": losses, "weights_sum": float(weights.double().sum()),
            "weights": weights[::997].tolist()}


def main(params: dict) -> None:
    device = start_rank(params)
    result({name: train(device, name, params["steps"], params["accum"]) for name in ("deepspeed", "dstrain")})


if __name__ == "__main__":
    main(parameters())
