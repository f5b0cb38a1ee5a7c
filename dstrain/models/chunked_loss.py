"""The LM head and its cross-entropy in chunks of tokens, never holding the whole [tokens, vocabulary]
logits (train.loss_chunking).

The reference computation is `F.cross_entropy(F.linear(hidden, weight, bias).float(), labels,
ignore_index=-100)`: logits in the compute dtype, upcast to fp32, mean over the tokens whose label is
not ignored. For 4 x 1024 tokens and Qwen2.5's 151,936-token vocabulary that keeps 2.3 GiB of fp32
log-probabilities for backward and needs two more fp32 copies at the backward's start. Here the rows go
through `chunk` at a time: one chunk's logits in the compute dtype, upcast to fp32 for its logsumexp,
and, in the same pass, the chunk's gradient (softmax - one-hot) / count turned straight into the
gradients w.r.t. the hidden states and the weight (and bias). Only those gradients (the size of the
inputs, not of the logits) wait for backward, which scales them by the incoming gradient.

Why the gradients in the forward (the approach of Liger-Kernel's fused linear cross-entropy) and not a
recomputation in backward: the logits are computed once, so the head costs its 3 matrix products as in
the reference, not 4; and under ZeRO-3 the head's weight is needed gathered only in the forward. The
price: the weight's gradient (vocabulary x width, fp32 while it is summed over chunks, then in the
weight's dtype) exists from the forward on, and the function is meant to be the last step of a loss,
called once per backward (a second backward through it raises).

`chunked_cross_entropy` is the entry point; `LMHeadLoss` is the module dstrain's models call it through,
so that DeepSpeed ZeRO-3 gathers the head's weight around it (see there). Under torch.compile dynamo
traces the function whole, its chunk loop unrolled (checked once on CPU: same loss and gradients, no graph
break; its memory and speed compiled are not measured).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk: int, ignore_index: int, reduction: str):
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        rows = hidden.shape[0]
        ignored = labels == ignore_index
        # The mean's denominator, a device tensor (no host sync); 0 real tokens gives nan, as the reference.
        # "sum" (sequence parallelism adds its ranks' sums before dividing): 1.
        count = ((~ignored).sum() if reduction == "mean" else torch.ones((), device=hidden.device)).to(torch.float32)
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_bias else None
        # The compute dtype: autocast's (over fp32 weights), else the weight's. The weight is cast once,
        # not in every chunk's product (autocast keeps such a copy for backward too).
        device_type = hidden.device.type
        compute = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
        w = weight.to(compute)
        b = None if bias is None else bias.to(compute)
        for start in range(0, rows, chunk):
            end = min(start + chunk, rows)
            h = hidden[start:end].to(compute)
            keep = ~ignored[start:end]
            target = torch.where(keep, labels[start:end], 0).unsqueeze(1)
            logits = F.linear(h, w, b).float()  # this chunk's logits only, upcast as the reference does
            lse = torch.logsumexp(logits, dim=-1)
            loss_sum += ((lse - logits.gather(1, target).squeeze(1)) * keep).sum()
            if not (need_hidden or need_weight or need_bias):
                continue
            # d(sum of losses)/d(logits) = softmax - one-hot on kept rows, built in place in the fp32 logits;
            # then the mean's 1/count, in fp32, before the cast to the compute dtype (as the reference).
            grad = logits.sub_(lse.unsqueeze(1)).exp_()
            grad.scatter_add_(1, target, -keep.to(grad.dtype).unsqueeze(1))
            grad.mul_((keep.to(grad.dtype) / count).unsqueeze(1))
            grad = grad.to(compute)
            if need_hidden:
                grad_hidden[start:end] = grad @ w
            if need_weight:  # the product in the compute dtype, summed into fp32 without an fp32 copy of it
                grad_weight.add_(grad.t() @ h)
            if need_bias:
                grad_bias.add_(grad.sum(0, dtype=torch.float32))
        ctx.grads = (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                     None if grad_bias is None else grad_bias.to(bias.dtype))
        return loss_sum / count

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.grads is None:
            raise RuntimeError("chunked_cross_entropy computes its gradients in the forward: backward runs once "
                               "per forward (no retain_graph)")
        grads = tuple(None if g is None else g.mul_(grad_loss.to(g.dtype)) for g in ctx.grads)
        ctx.grads = None
        return (*grads, None, None, None, None)


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                          bias: torch.Tensor | None = None, chunk: int = 1024,
                          ignore_index: int = IGNORE_INDEX, reduction: str = "mean") -> torch.Tensor:
    """Mean (or, with reduction "sum", the sum of the) cross-entropy of `F.linear(hidden, weight, bias)`
    against `labels` over the tokens whose label is not `ignore_index`, `chunk` tokens at a time. hidden
    [..., d], weight [V, d], labels [...] (the same leading shape); returns an fp32 scalar (see the module
    docstring)."""
    if chunk < 1:
        raise ValueError(f"chunk must be positive, got {chunk}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    if labels.shape[0] != hidden.shape[0]:
        raise ValueError(f"{labels.shape[0]} labels for {hidden.shape[0]} hidden states")
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, bias, labels, chunk, ignore_index, reduction)


def reference_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                            bias: torch.Tensor | None = None, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """What chunked_cross_entropy replaces: the whole logits, upcast to fp32, then torch's cross-entropy."""
    logits = F.linear(hidden, weight, bias).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=ignore_index)


class LMHeadLoss(nn.Module):
    """The loss through an LM head, as a module of the model: `forward(hidden, labels)` returns the mean
    cross-entropy of head(hidden), in chunks of `chunk` tokens.

    The head (an nn.Linear, whose weight may be tied to the input embedding) stays where the model keeps
    it: it is held here outside the module tree, so that no parameter gets a second name in state_dict.
    Under ZeRO-3 its weight is partitioned and gathered only around the forward of a module that owns
    or registered it; the chunked loss uses it here, not in the head's own forward, so it is registered
    as this module's external parameter (deepspeed.zero.register_external_parameter): DeepSpeed gathers
    it before this forward and releases it after, and again around this module's backward.
    """

    def __init__(self, head: nn.Linear, chunk: int):
        super().__init__()
        self._head = (head,)  # a tuple: not a submodule
        self.chunk = chunk
        for param in (head.weight, head.bias):
            if param is not None and hasattr(param, "ds_id"):  # built under deepspeed.zero.Init
                import deepspeed
                deepspeed.zero.register_external_parameter(self, param)

    @property
    def head(self) -> nn.Linear:
        return self._head[0]

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        head = self.head
        return chunked_cross_entropy(hidden, head.weight, labels, head.bias, self.chunk, reduction=reduction)

    def extra_repr(self) -> str:
        return f"chunk={self.chunk}"
