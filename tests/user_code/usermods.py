"""User code for tests/test_user_code.py (and test_hangs.py, test_trackers.py, test_tracking_run.py), imported as entry points from this directory ("usermods:...").

A model and datasets written the way a user would: nothing here imports dstrain.
"""

import json
import time
from pathlib import Path

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


def numbered_pairs(size: int = 256, d_in: int = 4):
    """`pairs`, each with its item number: (x, y, i)."""
    x, y = pairs(size, d_in).tensors
    return TensorDataset(x, y, torch.arange(size))


class Poisoned(Linear):
    """Linear on numbered pairs, whose training loss is infinite when a batch holds a `poison` item:
    a bad batch, as a NaN-producing record in real data would be."""

    def __init__(self, d_in: int, poison):
        super().__init__(d_in)
        self.poison = set(poison)

    def forward(self, batch):
        x, y, item = batch
        loss = F.mse_loss(self.layer(x).squeeze(-1), y)
        if self.training and self.poison.intersection(item.tolist()):
            loss = loss * float("inf")
        return loss


def poisoned(d_in: int = 4, poison=()):
    return Poisoned(d_in, poison)


def wait_forever():
    while True:
        time.sleep(3600)


class HangsOnRank1(Linear):
    """A deadlock in user code: rank 1 blocks forever in its `at_step`-th training forward."""

    def __init__(self, d_in: int, at_step: int):
        super().__init__(d_in)
        self.at_step = at_step
        self.calls = 0

    def forward(self, batch):
        if self.training:
            self.calls += 1
            if self.calls == self.at_step and torch.distributed.get_rank() == 1:
                wait_forever()
        return super().forward(batch)


def hangs_on_rank1(d_in: int = 4, at_step: int = 5):
    return HangsOnRank1(d_in, at_step)


class JsonLinesTracker:
    """A tracker of one's own (train.log_to: usermods:JsonLinesTracker): every record it gets, one JSON
    line each, in RUN_DIR/user_tracker.jsonl."""

    def __init__(self, run_dir, hparams, start_step):
        self.file = open(Path(run_dir) / "user_tracker.jsonl", "a")
        self._write({"opened_at": start_step, "lr": hparams["train.lr"]})

    def _write(self, record):
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def log_metrics(self, step, values):
        self._write({"step": step, **values})

    def log_event(self, step, kind, fields):
        self._write({"step": step, "event": kind})

    def close(self):
        self._write({"closed": True})
        self.file.close()


class NotATracker:
    """Has no tracker methods: train.log_to refuses it."""

    def log(self, values):
        pass
