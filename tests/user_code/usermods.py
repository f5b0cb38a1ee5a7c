"""User code for tests/test_user_code.py, imported as entry points from this directory ("usermods:...").

A model and datasets written the way a user would: nothing here imports dstrain.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset


class Linear(nn.Module):
    """y = x . w + b, with the loss as the protocol asks."""

    def __init__(self, d_in: int):
        super().__init__()
        self.layer = nn.Linear(d_in, 1)

    def forward(self, batch):
        x, y = batch
        return F.mse_loss(self.layer(x).squeeze(-1), y)


def build(d_in: int = 4):
    return Linear(d_in)


def pairs(size: int = 256, d_in: int = 4):
    """x, y = x . (0.1, 0.2, 0.3, ...): learnable exactly."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(size, d_in, generator=gen)
    return TensorDataset(x, x @ (torch.arange(1.0, d_in + 1) / 10))


class Indexed(Dataset):
    """Item i is i itself: shows which items a batch holds."""

    def __init__(self, size: int):
        self.size = size

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        return torch.tensor(i)


def indexed(size: int = 100):
    return Indexed(size)


def not_a_dataset():
    return [1, 2, 3].__iter__()


def not_a_module():
    return "a string"


def needs_width(width):
    return nn.Linear(width, 1)


class ReturnsOutputs(nn.Module):
    """Forgets the adapter: returns the output object, not the loss."""

    class Output(dict):
        @property
        def loss(self):
            return self["loss"]

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def forward(self, batch):
        x, y = batch
        return self.Output(loss=F.mse_loss(self.layer(x).squeeze(-1), y))


def returns_outputs():
    return ReturnsOutputs()
