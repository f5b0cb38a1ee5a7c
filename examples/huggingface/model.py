"""A Hugging Face model trained by dstrain: the one-line adapter.

dstrain's model protocol is forward(batch) -> loss. A Hugging Face model's forward returns an
output object whose `.loss` is set when labels are given, so the whole adapter is one line of
forward: hand the batch over as keyword arguments and return `.loss`.

Here the model is a GPT-2 built from a config (no download: weights start random, the vocabulary
is bytes, as in the default job). Start from pretrained weights instead with
`GPT2LMHeadModel.from_pretrained(name)` in `build`, and a matching data.tokenizer.

transformers is optional for dstrain: this example needs `pip install transformers`, and says so.
"""

from __future__ import annotations

import torch
from torch import nn

try:
    import transformers
except ImportError as err:  # a clear message instead of a bare ModuleNotFoundError
    raise ImportError("the Hugging Face example needs the transformers package: pip install transformers",
                      name="transformers") from err


class HFLoss(nn.Module):
    """The adapter: dstrain's (inputs, targets) byte batch in, the Hugging Face model's loss out."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, batch) -> torch.Tensor:
        # Hugging Face shifts the labels itself, so the labels are the inputs (the one line):
        return self.model(input_ids=batch[0], labels=batch[0]).loss


def build(n_layer: int = 4, n_head: int = 4, n_embd: int = 256, n_positions: int = 256, vocab_size: int = 256) -> HFLoss:
    """Model entry point: a randomly initialised GPT-2 of this shape, behind the adapter."""
    config = transformers.GPT2Config(n_layer=n_layer, n_head=n_head, n_embd=n_embd, n_positions=n_positions,
                                     vocab_size=vocab_size, bos_token_id=0, eos_token_id=0)
    return HFLoss(transformers.GPT2LMHeadModel(config))
