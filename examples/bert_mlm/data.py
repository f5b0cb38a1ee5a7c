"""Masked-language-model data for the BERT example: byte sequences with BERT's masking.

The data entry point of examples/bert_mlm/config.yaml: `examples.bert_mlm.data:masked_bytes`, called
with data.kwargs, returns a map-style torch Dataset. dstrain splits it (the last data.eval_fraction
of the items is held out), shards it over the ranks and orders it by a seeded permutation, so the
dataset itself only has to say what item i is.

Item i is window i of the text, `[CLS]` + seq_len - 1 bytes, with 15% of the byte positions chosen
for prediction; of those, 80% become `[MASK]`, 10% a random byte and 10% stay as they are (BERT's
rule, so the model cannot learn that only `[MASK]` positions matter). The choice is seeded by
(seed, i): the same item is masked the same way on every rank, in every epoch and after a resume.
"""

from __future__ import annotations

import glob
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from examples.bert_mlm.bert import CLS_ID, IGNORE, MASK_ID


class MaskedBytes(Dataset):
    def __init__(self, data: np.ndarray, seq_len: int, mask_prob: float, seed: int):
        if seq_len < 2:
            raise ValueError("seq_len must be at least 2 ([CLS] and one byte)")
        if not 0.0 < mask_prob < 1.0:
            raise ValueError(f"mask_prob must be in (0, 1), got {mask_prob}")
        self.data, self.width = data, seq_len - 1
        self.mask_prob, self.seed = mask_prob, seed

    def __len__(self) -> int:
        return len(self.data) // self.width

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        window = torch.from_numpy(np.asarray(self.data[index * self.width:(index + 1) * self.width], dtype=np.int64))
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        chosen = torch.rand(self.width, generator=gen) < self.mask_prob
        if not chosen.any():  # every item carries at least one label, so no batch has an empty loss
            chosen[torch.randint(self.width, (1,), generator=gen)] = True
        labels = torch.where(chosen, window, IGNORE)
        action = torch.rand(self.width, generator=gen)
        random_bytes = torch.randint(0, 256, (self.width,), generator=gen)
        inputs = torch.where(chosen & (action < 0.8), MASK_ID, window)
        inputs = torch.where(chosen & (action >= 0.8) & (action < 0.9), random_bytes, inputs)
        cls = torch.tensor([CLS_ID])
        return {"input_ids": torch.cat([cls, inputs]), "labels": torch.cat([torch.tensor([IGNORE]), labels])}


def _read_bytes(paths: str | list[str] | None) -> np.ndarray:
    if paths is None:  # the embedded corpus dstrain's default job trains on: no download
        from dstrain.data.sources import corpus_tokens
        return corpus_tokens()
    files = [Path(m) for pattern in ([paths] if isinstance(paths, str) else paths)
             for m in sorted(glob.glob(pattern, recursive=True)) if Path(m).is_file()]
    if not files:
        raise FileNotFoundError(f"no file matches {paths!r}")
    return np.frombuffer(b"\n".join(f.read_bytes() for f in files), dtype=np.uint8)


def masked_bytes(seq_len: int = 128, paths: str | list[str] | None = None, mask_prob: float = 0.15,
                 seed: int = 0) -> MaskedBytes:
    """The data entry point: MLM items from text files or globs (`paths`), or the embedded corpus."""
    return MaskedBytes(_read_bytes(paths), seq_len, mask_prob, seed)
