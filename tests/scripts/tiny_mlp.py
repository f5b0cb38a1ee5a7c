"""For scripts that train a small MLP with a real engine: the model (seeded, 6,337 parameters), a stack of
wider MLP blocks, and a training loop of random inputs, which can put a non-finite value into one micro-step's input."""

from __future__ import annotations

import torch


def tiny_mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                               torch.nn.GELU(), torch.nn.Linear(64, 1))


def mlp_stack(width: int, blocks: int) -> torch.nn.Sequential:
    """A GPT-shaped stack of MLP blocks (width -> 4 x width -> width), seeded: one fetch unit a Linear."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                                     torch.nn.Linear(4 * width, width)) for _ in range(blocks)])


def train_tiny_mlp(engine, micro_steps: int, dtype, device: str, overflow_at: int | None = None) -> list[float]:
    """Backward and step for each micro-step; the global gradient norm after each (DeepSpeed repeats the
    last update's between accumulation boundaries)."""
    generator = torch.Generator().manual_seed(1)
    norms = []
    for micro in range(micro_steps):
        x = torch.randn(4, 32, generator=generator) * 5
        if micro == overflow_at:
            x[0, 0] = float("inf")  # non-finite gradients: DeepSpeed skips this update
        engine.backward(engine(x.to(device=device, dtype=dtype)).float().pow(2).mean())
        engine.step()
        norm = engine.get_global_grad_norm()
        if norm is not None:
            norms.append(float(norm))
    return norms
