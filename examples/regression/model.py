"""Your own model and dataset, through entry points: an MLP regressing a smooth function.

The smallest complete example of the two entry points examples/regression/config.yaml names:

- `examples.regression.model:build` (model.name, called with model.kwargs) returns an nn.Module
  whose forward takes one batch and returns the loss: the dstrain model protocol.
- `examples.regression.model:dataset` (data.source, called with data.kwargs) returns a map-style
  torch Dataset. A batch is what torch's default_collate makes of its items: here the items are
  (x, y) tuples, so forward receives a list [x of shape (batch, d_in), y of shape (batch,)].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset


class MLP(nn.Module):
    def __init__(self, d_in: int, hidden: int, layers: int):
        super().__init__()
        widths = [d_in] + [hidden] * layers
        blocks = []
        for a, b in zip(widths, widths[1:]):
            blocks += [nn.Linear(a, b), nn.GELU()]
        self.net = nn.Sequential(*blocks, nn.Linear(widths[-1], 1))

    def forward(self, batch) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x).squeeze(-1), y)  # the protocol: return the loss


def build(d_in: int = 8, hidden: int = 64, layers: int = 2) -> MLP:
    """Model entry point (model.kwargs are its arguments)."""
    return MLP(d_in, hidden, layers)


def dataset(size: int = 8192, d_in: int = 8, noise: float = 0.05, seed: int = 0) -> TensorDataset:
    """Data entry point: y = sin(x . w) + noise for Gaussian x. The same seed gives the same data on every
    rank, which is what lets dstrain shard it by index."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(size, d_in, generator=gen)
    w = torch.randn(d_in, generator=gen) / d_in ** 0.5
    y = torch.sin(2.0 * x @ w) + noise * torch.randn(size, generator=gen)
    return TensorDataset(x, y)
