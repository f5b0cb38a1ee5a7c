"""A small BERT encoder trained with masked-language modelling (Devlin et al., 2018), from scratch.

The model entry point of examples/bert_mlm/config.yaml: `examples.bert_mlm.bert:build`, called with
model.kwargs. It follows the dstrain model protocol: forward(batch) takes one batch of the data
entry point (`examples.bert_mlm.data:masked_bytes`, a dict of input_ids and labels) and returns the
loss. Bytes are the vocabulary (0-255) plus two special tokens, so no tokenizer is needed.

What is BERT here: post-LayerNorm encoder blocks with bidirectional attention and GELU MLPs,
learned position embeddings, and the MLM head (dense, GELU, LayerNorm, decoder tied to the token
embedding). Left out: the next-sentence objective and token-type embeddings, which later work
(RoBERTa) found unnecessary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MASK_ID = 256  # after the 256 byte values
CLS_ID = 257
VOCAB_SIZE = 258
IGNORE = -100  # label of positions that were not masked: no loss there


class EncoderLayer(nn.Module):
    def __init__(self, d_model: int, n_head: int, d_ff: int, dropout: float):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.attn_out = nn.Linear(d_model, d_model)
        self.ln_attn = nn.LayerNorm(d_model, eps=1e-12)
        self.ff_in = nn.Linear(d_model, d_ff)
        self.ff_out = nn.Linear(d_ff, d_model)
        self.ln_ff = nn.LayerNorm(d_model, eps=1e-12)
        self.dropout = dropout
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = (t.view(batch, seq, self.n_head, width // self.n_head).transpose(1, 2)
                   for t in self.qkv(x).split(width, dim=2))
        # Every position attends to every other: no causal mask, which is what makes it an encoder.
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        x = self.ln_attn(x + self.drop(self.attn_out(a.transpose(1, 2).reshape(batch, seq, width))))
        return self.ln_ff(x + self.drop(self.ff_out(F.gelu(self.ff_in(x)))))


class BertMLM(nn.Module):
    def __init__(self, d_model: int, n_layer: int, n_head: int, d_ff: int, max_len: int, dropout: float):
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"n_head={n_head} must divide d_model={d_model}")
        self.max_len = max_len
        self.tok = nn.Embedding(VOCAB_SIZE, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.ln_emb = nn.LayerNorm(d_model, eps=1e-12)
        self.drop = nn.Dropout(dropout)
        self.layers = nn.ModuleList(EncoderLayer(d_model, n_head, d_ff, dropout) for _ in range(n_layer))
        self.head = nn.Sequential(nn.Linear(d_model, d_model), nn.GELU(), nn.LayerNorm(d_model, eps=1e-12))
        self.decoder = nn.Linear(d_model, VOCAB_SIZE)
        self.decoder.weight = self.tok.weight  # tied, as in BERT
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)  # BERT's initializer_range
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        ids, labels = batch["input_ids"], batch["labels"]
        if ids.shape[1] > self.max_len:
            raise ValueError(f"sequences of {ids.shape[1]} tokens exceed max_len={self.max_len} (model.kwargs)")
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.drop(self.ln_emb(self.tok(ids) + self.pos(positions)))
        for layer in self.layers:
            x = layer(x)
        # Only masked positions carry a label; decoding just those saves most of the head's work.
        picked = labels != IGNORE
        logits = self.decoder(self.head(x[picked]))
        return F.cross_entropy(logits.float(), labels[picked])


def build(d_model: int = 256, n_layer: int = 4, n_head: int = 4, d_ff: int = 1024, max_len: int = 512,
          dropout: float = 0.1) -> BertMLM:
    """The model entry point: BERT-style encoder + MLM head; the keyword arguments come from model.kwargs."""
    return BertMLM(d_model, n_layer, n_head, d_ff, max_len, dropout)
