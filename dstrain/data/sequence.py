"""Batches under sequence parallelism (train.sequence_parallel = N > 1): which samples a rank takes, and
its share of their tokens.

The N ranks of one sequence-parallel group (global ranks g*N .. g*N + N - 1, as DeepSpeed's
parallel_state_sp makes them) take the same samples: data-parallel rank g of world / N, so the sample
layout of dstrain.data.sampler (and with it exact resume) is that of a world of world / N ranks. Each
rank then keeps the tokens [r*L/N, (r+1)*L/N) of every sample, r its rank in the group. The labels are
shifted to the token they predict before the split (`shift_labels`), so the last token of one share
still predicts the first of the next; the position ids are the tokens' places in the whole sample,
which DeepSpeed's Ulysses attention gathers back to mask causally over the whole sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Layout:
    """Where a rank stands: its data-parallel rank and size (which samples) and its sequence-parallel rank
    and size (which tokens of them). Without sequence parallelism: the global rank and world, one share."""

    data_rank: int
    data_world: int
    sequence_rank: int = 0
    sequence_parallel: int = 1

    @classmethod
    def of(cls, rank: int, world: int, sequence_parallel: int) -> "Layout":
        return cls(rank // sequence_parallel, world // sequence_parallel, rank % sequence_parallel, sequence_parallel)

    def share(self, batch):
        """This rank's part of a whole micro batch (the batch itself without sequence parallelism)."""
        if self.sequence_parallel == 1:
            return batch
        return shard(shifted(batch), self.sequence_rank, self.sequence_parallel)


def shifted(batch) -> dict[str, torch.Tensor]:
    """{input_ids, position_ids, shift_labels} of a batch: shift_labels[t] is the label of token t + 1
    (-100 after the last token). Takes dstrain's (inputs, targets) windows, whose targets are shifted
    already, and labelled dicts in Hugging Face's unshifted convention."""
    if isinstance(batch, dict):
        inputs, labels = batch["input_ids"], batch["labels"]
        targets = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
        positions = batch.get("position_ids")
    else:
        inputs, targets = batch
        positions = None
    if positions is None:
        positions = torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs)
    return {"input_ids": inputs, "position_ids": positions, "shift_labels": targets}


def shard(batch: dict[str, torch.Tensor], rank: int, parts: int) -> dict[str, torch.Tensor]:
    """Tokens [rank*L/parts, (rank+1)*L/parts) of every tensor of a [batch, L] batch."""
    length = batch["input_ids"].shape[1]
    assert length % parts == 0, "resolution checks that data.seq_len divides by sequence_parallel"
    size = length // parts
    return {key: value[:, rank * size:(rank + 1) * size].contiguous() for key, value in batch.items()}
