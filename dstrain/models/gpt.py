"""The built-in GPT family: a pre-norm decoder-only transformer with PyTorch SDPA attention.

forward(batch) takes (inputs, targets) token tensors, or {"input_ids", "labels"} with labels aligned
to the inputs and -100 where no loss is taken (see dstrain.data), and returns the mean cross-entropy
loss, which is the model protocol every dstrain model follows. A dict batch with "position_ids"
holds packed examples: positions restart at 0 where an example starts, and attention is then
causal within each example only (SDPA with a block-diagonal mask; without position_ids the causal
kernel runs as before). Blocks can be recomputed in backward
through DeepSpeed's activation checkpointing (set by the train loop, see `enable_checkpointing`).
With `loss_chunk` (train.loss_chunking) the head and its cross-entropy run that many tokens at a time
(dstrain.models.chunked_loss), never holding the whole fp32 logits.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dstrain.models.chunked_loss import LMHeadLoss
from dstrain.models.preference import LogpsHead, LogpsRequest


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.dropout = dropout

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        # (batch, heads, seq, head_dim) for SDPA, which picks flash/memory-efficient kernels when it can
        q, k, v = (t.view(batch, seq, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model, bias=False), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * d_model, d_model, bias=False))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x), mask))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, seq_len: int, d_model: int, n_layer: int, n_head: int, dropout: float = 0.0,
                 loss_chunk: int | None = None):
        super().__init__()
        self.seq_len = seq_len
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied input/output embeddings, as in GPT-2
        self.lm_loss = LMHeadLoss(self.head, loss_chunk) if loss_chunk else None
        self.logps_head: nn.Module | None = None  # preference objectives (dstrain.models.preference.attach)
        self.preference = None
        self.checkpoint_fn: Callable | None = None
        self.apply(self._init_weights)
        for name, param in self.named_parameters():  # scaled init of residual projections (GPT-2)
            if name.endswith("attn.proj.weight") or name.endswith("mlp.2.weight"):
                torch.nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            torch.nn.init.zeros_(module.bias)

    def enable_checkpointing(self, checkpoint_fn: Callable) -> None:
        """Recompute each block in backward with `checkpoint_fn(block, x)` (DeepSpeed's checkpoint)."""
        self.checkpoint_fn = checkpoint_fn

    def forward(self, batch) -> torch.Tensor:
        if isinstance(batch, LogpsRequest):  # a preference reference copy: per-token log-probs
            return self.token_logps(*batch)
        if self.preference is not None and isinstance(batch, dict) and "example_ids" in batch:
            return self.preference(self, batch)
        if isinstance(batch, dict):  # {input_ids, labels}: labels aligned with the inputs, -100 = no loss
            inputs = batch["input_ids"]
            targets = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)  # position t predicts label t + 1
        else:
            inputs, targets = batch
        x = self.hidden_states(inputs, batch["position_ids"] if isinstance(batch, dict) and "position_ids" in batch
                               else None)
        if self.lm_loss is not None:
            return self.lm_loss(x, targets)
        logits = self.head(x)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100)

    def hidden_states(self, inputs: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """The last hidden states, after the final norm (the forward without the head); `positions`: the
        position ids of packed rows (attention then stays within each example)."""
        packed = positions is not None
        if not packed:
            positions = torch.arange(inputs.shape[1], device=inputs.device)
        x = self.drop(self.tok_emb(inputs) + self.pos_emb(positions))
        args = (document_mask(positions),) if packed else ()
        for block in self.blocks:
            x = self.checkpoint_fn(block, x, *args) if self.checkpoint_fn and self.training else block(x, *args)
        return self.ln_f(x)

    def enable_logps(self, chunk: int) -> None:
        """Preference objectives: per-token log-probs through the (tied) head, `chunk` tokens at a time."""
        self.logps_head = LogpsHead(self.head, chunk)

    def token_logps(self, inputs: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """log p(target) per position (0 where the target is -100), through the preference head."""
        return self.logps_head(self.hidden_states(inputs, positions), targets)


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """[batch, 1, seq, seq] boolean attention mask (True: may attend) of packed examples: causal, and
    only within the example, which starts wherever the position ids do not step by one."""
    step = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
    document = (step != 1).cumsum(-1)
    seq = position_ids.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=position_ids.device).tril()
    return ((document[:, :, None] == document[:, None, :]) & causal)[:, None]


def flops_per_token(n_params: int, n_layer: int, d_model: int, seq_len: int, vocab_size: int) -> float:
    """Training FLOPs per token of the built-in GPT: 6 x the parameters used in matrix products
    (forward + backward) plus 12 x layers x width x sequence for the attention scores (Kaplan et
    al. 2020; PaLM appendix B). The token and position embeddings are lookups, not products, so they
    are left out; the LM head shares the token embedding's weight but is a real (width x vocabulary)
    product on every token, so it is counted: 6 x vocabulary x width."""
    embedding = (vocab_size + seq_len) * d_model  # tok_emb + pos_emb lookups
    head = vocab_size * d_model  # the tied LM head's matrix product
    return 6.0 * (n_params - embedding + head) + 12.0 * n_layer * d_model * seq_len
