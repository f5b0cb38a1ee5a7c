"""Deterministic, resumable batches for each rank.

Sample i of the run (counted over all ranks) is window perm_e[i mod W] of the token stream, where
W is the number of non-overlapping windows and perm_e a permutation seeded by (seed, epoch e).
Optimizer step s, micro step m, rank r takes samples s*G + (m*world + r)*micro ... + micro - 1,
with G the global batch. So the data position is a pure function of the step: resuming at step s
(even with another world size, as long as G is kept) continues with exactly the same samples.

Every sampler has `size` (samples in one pass over its split; None when endless) and
`real_tokens(first, count)` / `examples(first, count)`: the non-pad tokens and the examples in
those samples, pure functions of the sample indices (so rank 0 counts a whole global batch without
asking the other ranks).
"""

from __future__ import annotations

import numpy as np
import torch

from dstrain.data.binpack import efficiency, pack_rows


class WindowSampler:
    """Fixed-length (input, target) windows from a token stream, in a seeded order.

    With `vocab_size` set (the built-in GPT), every batch is checked for token ids the model's
    embedding cannot hold: a clear error instead of an index error (or a CUDA assert) mid-step."""

    def __init__(self, tokens, seq_len: int, seed: int, vocab_size: int | None = None):
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.vocab_size = vocab_size
        self.windows = (len(tokens) - 1) // seq_len
        assert self.windows > 0, "the split guarantees at least one window"
        self.size = self.windows
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    def real_tokens(self, _first: int, count: int) -> int:
        return count * self.seq_len

    def examples(self, _first: int, count: int) -> int:
        return count

    def _window_of(self, sample: int) -> int:
        epoch, offset = divmod(sample, self.windows)
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.windows)
            self._perm_epoch = epoch
        return int(self._perm[offset])

    def batch(self, first_sample: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = []
        for sample in range(first_sample, first_sample + count):
            start = self._window_of(sample) * self.seq_len
            rows.append(np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int64))
        block = torch.from_numpy(np.stack(rows))
        if self.vocab_size is not None and int(block.max()) >= self.vocab_size:
            from dstrain.errors import UserError
            raise UserError.single(f"the data holds token id {int(block.max())}, but model.vocab_size is "
                                   f"{self.vocab_size}", "model.vocab_size",
                                   f"set model.vocab_size to at least {int(block.max()) + 1} (the tokenizer's "
                                   "vocabulary; GPT-2 tokens: 50257, or 50304 rounded up)")
        return block[:, :-1], block[:, 1:]


class SyntheticSampler:
    """Random tokens (seeded by the sample index): for benchmarks, where the data must cost nothing."""

    size = None  # endless

    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed

    def real_tokens(self, _first: int, count: int) -> int:
        return count * self.seq_len

    def examples(self, _first: int, count: int) -> int:
        return count

    def batch(self, first_sample: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + first_sample)
        block = torch.randint(0, self.vocab_size, (count, self.seq_len + 1), generator=gen)
        return block[:, :-1], block[:, 1:]


class DatasetSampler:
    """A user's torch Dataset (from an entry point): item i of the seeded order, collated by stacking."""

    def __init__(self, dataset, seed: int):
        self.dataset, self.seed = dataset, seed
        self.windows = self.size = len(dataset)
        self._perm_epoch, self._perm = -1, None

    def real_tokens(self, _first: int, _count: int) -> None:
        return None  # a user's items: dstrain cannot tell padding from tokens

    def examples(self, _first: int, count: int) -> int:
        return count

    def batch(self, first_sample: int, count: int):
        items = []
        for sample in range(first_sample, first_sample + count):
            epoch, offset = divmod(sample, self.windows)
            if epoch != self._perm_epoch:
                self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.windows)
                self._perm_epoch = epoch
            items.append(self.dataset[int(self._perm[offset])])
        return torch.utils.data.default_collate(items)


def rank_batch(sampler, step: int, micro_step: int, rank: int, world: int, micro: int, accum: int):
    """The micro batch of (step, micro_step) for one rank; see the module docstring for the layout."""
    global_batch = micro * accum * world
    first = step * global_batch + (micro_step * world + rank) * micro
    return sampler.batch(first, micro)


def to_device(batch, device):
    """A batch (tensor, or lists/tuples/dicts of them) on the training device."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


class SeededOrder:
    """Item perm_e[i mod n] for sample i: a permutation of n items seeded by (seed, epoch e)."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed
        self._epoch, self._perm = -1, None

    def item(self, sample: int) -> int:
        epoch, offset = divmod(sample, self.n)
        if epoch != self._epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
            self._epoch = epoch
        return int(self._perm[offset])


class PackedSampler:
    """Labelled batches from a packed token stream (format "text"): non-overlapping windows of
    seq_len tokens, {"input_ids": window, "labels": window} (the model shifts; see dstrain.data)."""

    def __init__(self, tokens, seq_len: int, seed: int):
        self.tokens, self.seq_len = tokens, seq_len
        self.order = SeededOrder(len(tokens) // seq_len, seed)
        assert self.order.n > 0, "the split guarantees at least one window"
        self.size = self.order.n

    def real_tokens(self, _first: int, count: int) -> int:
        return count * self.seq_len

    def examples(self, _first: int, count: int) -> int:
        return count

    def batch(self, first_sample: int, count: int) -> dict[str, torch.Tensor]:
        rows = []
        for sample in range(first_sample, first_sample + count):
            start = self.order.item(sample) * self.seq_len
            rows.append(np.asarray(self.tokens[start:start + self.seq_len], dtype=np.int64))
        block = torch.from_numpy(np.stack(rows))
        return {"input_ids": block, "labels": block.clone()}


class ExampleSampler:
    """Labelled batches of whole examples (formats "prompt_response" and "chat"), one per row,
    right-padded to seq_len with pad_id (labels -100 there). Example i is ids[offsets[i]:offsets[i + 1]]."""

    packed = False

    def __init__(self, ids, labels, offsets, seq_len: int, pad_id: int, seed: int):
        self.ids, self.labels, self.offsets = ids, labels, offsets
        self.seq_len, self.pad_id = seq_len, pad_id
        self.order = SeededOrder(len(offsets) - 1, seed)
        assert self.order.n > 0, "the split guarantees at least one example"
        self.size = self.order.n
        self.lengths = np.diff(np.asarray(offsets, dtype=np.int64))

    @property
    def efficiency(self) -> float:
        """Real tokens / row tokens over one pass."""
        return efficiency(self.lengths, self.size, self.seq_len)

    def real_tokens(self, first: int, count: int) -> int:
        return int(sum(self.lengths[self.order.item(s)] for s in range(first, first + count)))

    def examples(self, _first: int, count: int) -> int:
        return count

    def batch(self, first_sample: int, count: int) -> dict[str, torch.Tensor]:
        input_ids = torch.full((count, self.seq_len), self.pad_id, dtype=torch.int64)
        labels = torch.full((count, self.seq_len), -100, dtype=torch.int64)
        for row, sample in enumerate(range(first_sample, first_sample + count)):
            item = self.order.item(sample)
            start, stop = int(self.offsets[item]), int(self.offsets[item + 1])
            input_ids[row, :stop - start] = torch.from_numpy(np.asarray(self.ids[start:stop], dtype=np.int64))
            labels[row, :stop - start] = torch.from_numpy(np.asarray(self.labels[start:stop], dtype=np.int64))
        return {"input_ids": input_ids, "labels": labels}


class PackedExampleSampler:
    """Labelled batches of whole examples packed several to a row (formats other than "text", with
    data.packing on): {"input_ids", "labels", "position_ids"}.

    Rows are made once (`pack_rows`, seeded) and visited in a seeded order per epoch, so sample i is
    a pure function of (seed, i), as for ExampleSampler. Each example's position ids restart at 0,
    which tells the model where examples begin (it must not attend across them). The label at each
    example's first token is -100: the model predicts labels[t + 1] from position t, and the last
    token of one example must not be asked for the first token of the next. A row's padding continues
    the last example's positions (under causal attention no real token sees it) with labels -100."""

    packed = True

    def __init__(self, ids, labels, offsets, seq_len: int, pad_id: int, seed: int):
        self.ids, self.labels = ids, labels
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.seq_len, self.pad_id = seq_len, pad_id
        self.lengths = np.diff(self.offsets)
        assert len(self.lengths) and int(self.lengths.max()) <= seq_len, "examples are cut to seq_len when encoded"
        self.items, self.row_offsets = pack_rows(self.lengths, seq_len, seed)
        self.size = len(self.row_offsets) - 1
        self.row_tokens = np.add.reduceat(self.lengths[self.items], self.row_offsets[:-1])
        self.order = SeededOrder(self.size, seed)

    @property
    def efficiency(self) -> float:
        """Real tokens / row tokens over one pass."""
        return efficiency(self.lengths, self.size, self.seq_len)

    def row_examples(self, row: int) -> np.ndarray:
        return self.items[self.row_offsets[row]:self.row_offsets[row + 1]]

    def real_tokens(self, first: int, count: int) -> int:
        return int(sum(self.row_tokens[self.order.item(s)] for s in range(first, first + count)))

    def examples(self, first: int, count: int) -> int:
        return int(sum(len(self.row_examples(self.order.item(s))) for s in range(first, first + count)))

    def batch(self, first_sample: int, count: int) -> dict[str, torch.Tensor]:
        input_ids = np.full((count, self.seq_len), self.pad_id, dtype=np.int64)
        labels = np.full((count, self.seq_len), -100, dtype=np.int64)
        positions = np.empty((count, self.seq_len), dtype=np.int64)
        for row, sample in enumerate(range(first_sample, first_sample + count)):
            at = 0
            for item in self.row_examples(self.order.item(sample)):
                start, stop = int(self.offsets[item]), int(self.offsets[item + 1])
                end = at + stop - start
                input_ids[row, at:end] = self.ids[start:stop]
                labels[row, at + 1:end] = self.labels[start + 1:stop]
                positions[row, at:] = np.arange(self.seq_len - at)  # the padding continues the last example
                at = end
        return {"input_ids": torch.from_numpy(input_ids), "labels": torch.from_numpy(labels),
                "position_ids": torch.from_numpy(positions)}


class PreferenceSampler:
    """Batches of format "preference" (dstrain/data/preference.py, PreferenceRows): whole pairs (or KTO's
    examples) packed into rows, or one example a row. A sample is a packed row, or, padded, a unit (a pair,
    whose two examples take two rows of the batch: chosen rows first; a KTO example, one row). The batch is
    {"input_ids", "labels", "position_ids", "example_ids", "desirable"} and, for pairs, "margin": see
    PreferenceRows.layout. Sample i is a pure function of (seed, i), as for the other samplers."""

    def __init__(self, encoded, groups, seq_len: int, seed: int, paired: bool, packed: bool):
        from dstrain.data.preference import PreferenceRows, unit_offsets
        self.layout = PreferenceRows(encoded, unit_offsets(encoded, groups, paired), seq_len, seed, paired, packed)
        self.packed, self.paired, self.seq_len = packed, paired, seq_len
        self.lengths = self.layout.unit_lengths  # tokens per unit (pair or KTO example), as ExampleSampler's
        self.size = self.layout.rows() if packed else self.layout.count
        assert self.size > 0, "the split guarantees at least one pair"
        self.order = SeededOrder(self.size, seed)

    @property
    def efficiency(self) -> float:
        return self.layout.efficiency()

    def units_of(self, first: int, count: int) -> list[list[int]]:
        """Per packed row its units; padded, one list of the samples' units."""
        if self.packed:
            return [self.layout.row_units(self.order.item(s)).tolist() for s in range(first, first + count)]
        return [[self.order.item(s) for s in range(first, first + count)]]

    def real_tokens(self, first: int, count: int) -> int:
        return int(sum(self.layout.unit_lengths[u] for group in self.units_of(first, count) for u in group))

    def examples(self, first: int, count: int) -> int:
        return sum(len(group) for group in self.units_of(first, count))

    def batch(self, first_sample: int, count: int) -> dict[str, torch.Tensor]:
        arrays = self.layout.layout(self.units_of(first_sample, count))
        return {name: torch.from_numpy(value) for name, value in arrays.items()}
