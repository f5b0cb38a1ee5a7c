"""tests/test_zero3_autograd_apply.py's rank: trains a small GPT-like stack (linear layers with and without
bias, a layer norm) with ZeRO-3, with DeepSpeed's Function.apply and with dstrain's zero3_autograd_apply,
parameters on the device or offloaded, and sends back the losses, the trained weights, and how many of
DeepSpeed's Function calls took the lean path or torch's."""

from __future__ import annotations

import deepspeed
import torch

from dstrain.config.schema import SpeedupsConfig
from dstrain.speedups import apply, zero3_autograd_apply
from scripts.rank_setup import parameters, result, start_rank


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width, bias=False)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def train(device: str, variant: str, offload: bool, steps: int) -> dict:
    torch.manual_seed(0)
    width = 32
    model = torch.nn.Sequential(*[Block(width) for _ in range(3)], torch.nn.Linear(width, 1))
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if offload:
        zero["offload_param"] = zero["offload_optimizer"] = {"device": "cpu"}
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
              "zero_optimization": zero, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}}
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    applied = None
    calls = {"torch": 0}
    if variant == "dstrain":
        applied = "zero3_autograd_apply" in apply(engine, SpeedupsConfig(), only=("zero3_autograd_apply",)).applied
        torch_apply = zero3_autograd_apply._FUNCTION_APPLY

        def counted(cls, *args, **kwargs):  # counts the calls the lean path leaves to torch
            calls["torch"] += 1
            return torch_apply(cls, *args, **kwargs)

        zero3_autograd_apply._FUNCTION_APPLY = counted
        functions = zero3_autograd_apply._functions(engine)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps * 2):
        x = torch.randn(4, 8, width, generator=generator).to(device=device, dtype=torch.bfloat16)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    if variant == "dstrain":
        zero3_autograd_apply._FUNCTION_APPLY = torch_apply
        calls["classes"] = len(functions)
        calls["lean_classes"] = sum(cls.__dict__["apply"].__func__ is zero3_autograd_apply._apply for cls in functions)
    weights = torch.cat([p.ds_tensor.detach().float().flatten().cpu() for p in engine.module.parameters()])
    from deepspeed.runtime.zero.linear import zero3_linear_wrap
    return {"applied": applied, "calls": calls, "losses": losses, "weights": weights.tolist(),
            # memory_efficient_linear (on by default) sends nn.Linear through DeepSpeed's Function
            "linear_wrapped": torch.nn.functional.linear is zero3_linear_wrap}


def main(params: dict) -> None:
    device = start_rank(params)
    result({f"{name}-{'offload' if offload else 'device'}": train(device, name, offload, params["steps"])
            for offload in (False, True) for name in ("deepspeed", "dstrain")})


if __name__ == "__main__":
    main(parameters())
