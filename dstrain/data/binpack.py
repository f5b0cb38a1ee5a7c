"""How examples are packed into rows (data.packing): a seeded first-fit-decreasing bin packing.

numpy only (no torch), so `dstrain data preview` measures the packing without importing torch; the
sampler that builds the batches from it is dstrain/data/sampler.py (PackedExampleSampler).
"""

from __future__ import annotations

import numpy as np

PACK_BLOCK = 2048  # examples per first-fit-decreasing block: large enough to pack tightly, small enough to stay fast


def pack_rows(lengths: np.ndarray, seq_len: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Examples grouped into rows of at most seq_len tokens: (items, row_offsets), row j holding
    examples items[row_offsets[j]:row_offsets[j + 1]].

    The examples are shuffled (seeded), then each block of PACK_BLOCK examples is packed by
    first-fit-decreasing: longest first, each into the first row it fits. Blocks keep the cost near
    linear and mix short and long examples as the data does."""
    order = np.random.default_rng([seed, 0x9ACC]).permutation(len(lengths))
    items: list[int] = []
    row_offsets = [0]
    for start in range(0, len(order), PACK_BLOCK):
        block = order[start:start + PACK_BLOCK]
        block = block[np.argsort(-lengths[block], kind="stable")]
        free = np.empty(len(block), dtype=np.int64)  # room left in each open row
        rows: list[list[int]] = []
        for example in block:
            need = int(lengths[example])
            fits = np.flatnonzero(free[:len(rows)] >= need)
            if len(fits):
                row = int(fits[0])
            else:
                row = len(rows)
                rows.append([])
                free[row] = seq_len
            rows[row].append(int(example))
            free[row] -= need
        for row in rows:
            items += row
            row_offsets.append(len(items))
    return np.asarray(items, dtype=np.int64), np.asarray(row_offsets, dtype=np.int64)


def efficiency(lengths: np.ndarray, rows: int, seq_len: int) -> float:
    """Real tokens / row tokens: the share of the rows' positions that hold example tokens."""
    return float(np.sum(lengths)) / (rows * seq_len) if rows else 0.0
