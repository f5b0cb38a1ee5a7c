"""The math of preference training (train.objective dpo, simpo, orpo, kto, reward): per-token and
per-sequence log-probs, and the losses and metrics of TRL 1.16's DPOTrainer, CPOTrainer (SimPO, CPO),
ORPOTrainer, KTOTrainer and RewardTrainer, as plain functions of tensors. No model, no data, no reference
model here: the training loop computes the log-probs of the policy (and of the reference, or reads them
precomputed) and calls these.

Log-probs. `token_logps` takes logits, `head_token_logps` the hidden states and the LM head; both return the
fp32 log-probability of each label (0 where the label is ignored) and keep no fp32 copy of the logits for
backward: the forward goes `chunk` tokens at a time, and the backward recomputes each chunk's softmax
(from the saved logits, or from hidden @ weight). `segment_logps` then sums them per segment, a segment
being one completion: padded rows use the row index, packed rows the index of each example, so a row
holding the chosen and rejected completions of several pairs gives the same sums as one row each
(`shift_segment_ids` aligns a packed row's example ids with the shifted labels, never scoring across two
examples).
Convention, as TRL's concatenated batch: segments 0..P-1 are the chosen completions of pairs 0..P-1,
segments P..2P-1 their rejected ones (`chosen, rejected = logps.chunk(2)`).

Losses. Each function returns a `PreferenceLoss`: the scalar loss and a dict of detached scalar metrics
under TRL's names (rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen,
logps/rejected, and the trainer's own: nll_loss, log_odds_ratio, kl, accuracy, margin, ...). Metrics are
this batch's means, as TRL logs them on one process. tests/test_preference_loss.py checks every loss and
metric against TRL 1.16's own trainer methods (recorded by tests/scripts/record_trl_preference_losses.py).

The accepted names (loss types, f-divergences) and the argument checks live in dstrain.config.preference,
so that the config schema reads the same table without importing torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from dstrain.config.preference import (CPO_LOSS_TYPES, DPO_LOSS_TYPES, F_DIVERGENCE_LOSS_TYPES, F_DIVERGENCES,
                                       KTO_LOSS_TYPES, check_beta, check_choice, check_label_smoothing,
                                       check_loss_types, kto_mismatched_order)  # noqa: F401 - the KL rule, re-exported

IGNORE_INDEX = -100


@dataclass
class PreferenceLoss:
    """A preference loss: `loss` (a scalar to backward), `metrics` (detached scalars under TRL's names) and,
    for a weighted list of DPO losses, `terms`: each loss type's batch mean before its weight."""
    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]
    terms: dict[str, torch.Tensor] = field(default_factory=dict)


# --- per-token log-probs ---------------------------------------------------------------------------------

class _TokenLogps(torch.autograd.Function):
    """log_softmax(logits)[label] per token, fp32, `chunk` rows at a time; backward recomputes each chunk's
    softmax from the saved logits (in their own dtype) and the saved fp32 log-normalisers."""

    @staticmethod
    def forward(ctx, logits, labels, chunk: int, ignore_index: int):
        keep = labels != ignore_index
        target = torch.where(keep, labels, 0)
        out = torch.zeros(logits.shape[0], dtype=torch.float32, device=logits.device)
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        for start in range(0, logits.shape[0], chunk):
            end = min(start + chunk, logits.shape[0])
            part = logits[start:end].float()  # one chunk upcast at a time
            lse[start:end] = torch.logsumexp(part, dim=-1)
            picked = part.gather(1, target[start:end].unsqueeze(1)).squeeze(1)
            out[start:end] = (picked - lse[start:end]) * keep[start:end]
        ctx.save_for_backward(logits, target, keep, lse)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx, grad_out):
        logits, target, keep, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        g = grad_out.float() * keep  # d out_t / d logits_t = one-hot(label) - softmax, on kept tokens
        for start in range(0, logits.shape[0], ctx.chunk):
            end = min(start + ctx.chunk, logits.shape[0])
            part = (logits[start:end].float() - lse[start:end, None]).exp_().mul_(-g[start:end, None])
            part.scatter_add_(1, target[start:end].unsqueeze(1), g[start:end, None])
            grad[start:end] = part
        return grad, None, None, None


class _HeadTokenLogps(torch.autograd.Function):
    """As _TokenLogps, from hidden states and the LM head: the logits exist one chunk at a time, in the
    forward and again in the backward (one more matrix product than the unchunked head, no [tokens, vocab]
    tensor kept). The compute dtype is autocast's when it is on, else the weight's (as chunked_loss).

    Memory in the backward, where a step's peak often is (the fp32 head gradient is alive): the chunk's fp32
    probabilities are formed in place, and the head gradient's product is added `vocab_slice` rows at a time,
    so no [vocab, d] product exists beside it (at 1,024 x 128,256 x 2,048 in bf16: 0.5 GB less at that
    moment). Each gradient element is the same dot product as before."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk: int, ignore_index: int, vocab_slice: int):
        device_type = hidden.device.type
        compute = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
        keep = labels != ignore_index
        target = torch.where(keep, labels, 0)
        w = weight.to(compute)
        b = None if bias is None else bias.to(compute)
        out = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            end = min(start + chunk, hidden.shape[0])
            part = F.linear(hidden[start:end].to(compute), w, b).float()
            lse[start:end] = torch.logsumexp(part, dim=-1)
            picked = part.gather(1, target[start:end].unsqueeze(1)).squeeze(1)
            out[start:end] = (picked - lse[start:end]) * keep[start:end]
        ctx.save_for_backward(hidden, weight, bias, target, keep, lse)
        ctx.chunk, ctx.compute, ctx.vocab_slice = chunk, compute, vocab_slice
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, target, keep, lse = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        compute = ctx.compute
        w = weight.to(compute)
        b = None if bias is None else bias.to(compute)
        g = grad_out.float() * keep
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_bias else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            end = min(start + ctx.chunk, hidden.shape[0])
            h = hidden[start:end].to(compute)
            part = F.linear(h, w, b).float().sub_(lse[start:end, None]).exp_().mul_(-g[start:end, None])
            part.scatter_add_(1, target[start:end].unsqueeze(1), g[start:end, None])
            if need_bias:
                grad_bias.add_(part.sum(0))
            part = part.to(compute)
            if need_hidden:
                grad_hidden[start:end] = part @ w
            if need_weight:
                for row in range(0, part.shape[1], ctx.vocab_slice):
                    rows = slice(row, row + ctx.vocab_slice)
                    grad_weight[rows].add_(part[:, rows].t() @ h)
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype), None, None, None, None)


def token_logps(logits: torch.Tensor, labels: torch.Tensor, chunk: int = 1024,
                ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """log p(label) per position, fp32, shape of `labels`; 0 where the label is `ignore_index`. `labels`
    are aligned with `logits` (position t scores labels[t]: shift Hugging Face labels first, see
    `shift_labels`). No fp32 copy of the whole logits is made or kept for backward."""
    if chunk < 1:
        raise ValueError(f"chunk must be positive, got {chunk}")
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)}")
    flat = _TokenLogps.apply(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), chunk, ignore_index)
    return flat.view(labels.shape)


def head_token_logps(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                     bias: torch.Tensor | None = None, chunk: int = 1024,
                     ignore_index: int = IGNORE_INDEX, vocab_slice: int = 16384) -> torch.Tensor:
    """`token_logps` of `F.linear(hidden, weight, bias)` without the [tokens, vocabulary] logits: hidden
    [..., d], weight [V, d], labels [...] aligned with hidden. Under ZeRO-3 the head's weight must be gathered
    around this call's forward and backward (as dstrain.models.chunked_loss.LMHeadLoss arranges)."""
    if chunk < 1:
        raise ValueError(f"chunk must be positive, got {chunk}")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} does not match labels {tuple(labels.shape)}")
    flat = _HeadTokenLogps.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias, labels.reshape(-1), chunk,
                                 ignore_index, vocab_slice)
    return flat.view(labels.shape)


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Hugging Face's unshifted labels [..., T] as targets aligned with the logits: position t scores
    label t + 1, the last position nothing (as dstrain's models shift them)."""
    return F.pad(labels[..., 1:], (0, 1), value=ignore_index)


# --- per-sequence log-probs ------------------------------------------------------------------------------

def row_segment_ids(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Segment ids for a padded batch [B, T]: the row index where the label is scored, -1 elsewhere."""
    rows = torch.arange(labels.shape[0], device=labels.device).unsqueeze(1).expand_as(labels)
    return torch.where(labels != ignore_index, rows, -1)


def shift_segment_ids(example_ids: torch.Tensor, labels: torch.Tensor,
                      ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Segment ids aligned with `shift_labels(labels)` for packed rows: `example_ids` [..., T] gives, per
    input token, which completion (segment) it belongs to (-1 for none), `labels` are Hugging Face's
    unshifted labels. Position t scores token t + 1 for the segment of t + 1, and only when t and t + 1 belong
    to the same example: the last position of one example never scores the next example's first token
    (whose logit comes from the wrong example's context), even when that token is a label."""
    nxt = F.pad(example_ids[..., 1:], (0, 1), value=-1)
    scored = (shift_labels(labels, ignore_index) != ignore_index) & (nxt == example_ids) & (nxt >= 0)
    return torch.where(scored, nxt, -1)


def segment_logps(token_logps: torch.Tensor, segment_ids: torch.Tensor,
                  num_segments: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the token log-probs, number of scored tokens) per segment, each [num_segments] fp32.

    `segment_ids` has the shape of `token_logps` and is aligned with it (with the shifted labels): the
    completion each scored token belongs to, -1 for tokens not scored (prompt, padding, ignored labels).
    One index_add per output, so a packed row (several completions, each with its id) sums as if each
    completion had its row."""
    if segment_ids.shape != token_logps.shape:
        raise ValueError(f"segment ids {tuple(segment_ids.shape)} do not match log-probs {tuple(token_logps.shape)}")
    ids = segment_ids.reshape(-1)
    keep = ids >= 0
    index = torch.where(keep, ids, 0)
    values = torch.where(keep, token_logps.reshape(-1).float(), 0.0)
    sums = torch.zeros(num_segments, dtype=torch.float32, device=values.device).index_add(0, index, values)
    counts = torch.zeros(num_segments, dtype=torch.float32, device=values.device).index_add(0, index, keep.float())
    return sums, counts


def sequence_logps(token_logps: torch.Tensor, segment_ids: torch.Tensor, num_segments: int,
                   average: bool = False) -> torch.Tensor:
    """Log-prob of each segment's completion: the sum over its scored tokens, or with `average` the mean
    per token (SimPO's, ORPO's and CPO-IPO's length-normalised log-prob). An empty segment averages to nan,
    as TRL's division does."""
    sums, counts = segment_logps(token_logps, segment_ids, num_segments)
    return sums / counts if average else sums


# --- DPO -------------------------------------------------------------------------------------------------

def _f_scores(logratios: torch.Tensor, f_divergence: str, f_alpha: float) -> torch.Tensor:
    """f'(pi / pi_ref) of the f-DPO paper (TRL's f_divergence_type); reverse KL is the log-ratio itself."""
    if f_divergence == "reverse_kl":
        return logratios
    if f_divergence == "forward_kl":  # f'(t) = 1 - 1/t
        return 1 - torch.exp(-logratios)
    if f_divergence == "js_divergence":  # f'(t) = log(2t / (t + 1))
        return math.log(2) + F.logsigmoid(logratios)
    # alpha divergence: f'(t) = (t^(alpha - 1) - 1) / (alpha - 1); alpha -> 1 is reverse KL
    if abs(f_alpha - 1.0) < 1e-6:
        return logratios
    scaled = (f_alpha - 1.0) * logratios
    limit = {torch.float16: 11.0, torch.bfloat16: 80.0}.get(scaled.dtype, 80.0)  # exp stays representable
    return (torch.exp(torch.clamp(scaled.float(), max=limit)) - 1.0).to(scaled.dtype) / (f_alpha - 1.0)


def dpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
             ref_rejected_logps: torch.Tensor, *, loss_type: str | list[str] = "sigmoid",
             loss_weights: list[float] | None = None, beta: float = 0.1, label_smoothing: float = 0.0,
             discopop_tau: float = 0.05, f_divergence: str = "reverse_kl", f_alpha: float = 1.0,
             chosen_counts: torch.Tensor | None = None,
             rejected_counts: torch.Tensor | None = None) -> PreferenceLoss:
    """TRL 1.16's DPOTrainer loss: for each loss type its mean over the pairs, times its weight, summed.

    The log-probs are the completions' summed token log-probs [P] (policy and reference). The counts
    (scored tokens per completion) are needed by "ipo" and "sigmoid_norm", which divide each score by its
    completion's length, and by "sft", the NLL of the chosen completions: -(sum of their token log-probs)
    / (their token count), one value for the batch (the MPO / RPO term; weight it in `loss_weights`).

    As TRL 1.16, not as some peers: IPO is length-normalised per token (the score over the completion
    length; OpenRLHF squares the summed log-ratio difference); "sigmoid" ignores label_smoothing (only
    exo_pair, robust, aot and aot_unpaired read it: conservative DPO is "robust" here); "aot" and
    "aot_unpaired" sort over this batch's pairs (so over one micro-batch on one rank); the f-divergence
    applies to the losses in dstrain.config.preference.F_DIVERGENCE_LOSS_TYPES only. Metrics: rewards are
    beta times the log-ratios (not the f-scores), means over the pairs; logps/* the policy's summed log-probs.
    """
    names, weights = check_loss_types(loss_type, loss_weights, DPO_LOSS_TYPES)
    beta = check_beta(beta)
    check_choice(f_divergence, F_DIVERGENCES, "f-divergence")
    if f_divergence != "reverse_kl" and not set(names) <= set(F_DIVERGENCE_LOSS_TYPES):
        raise ValueError(f"f-divergence {f_divergence!r} applies to the loss types "
                         f"{', '.join(F_DIVERGENCE_LOSS_TYPES)} only, got {', '.join(names)}")
    check_label_smoothing(names, label_smoothing)
    if discopop_tau <= 0 and "discopop" in names:
        raise ValueError(f"discopop_tau must be > 0, got {discopop_tau}")
    needs_counts = [name for name in names if name in ("ipo", "sigmoid_norm", "sft")]
    if needs_counts and (chosen_counts is None or rejected_counts is None):
        raise ValueError(f"loss type {needs_counts[0]!r} needs chosen_counts and rejected_counts (tokens per "
                         "completion)")
    ls = label_smoothing
    chosen_ratios = chosen_logps - ref_chosen_logps
    rejected_ratios = rejected_logps - ref_rejected_logps
    chosen_scores = _f_scores(chosen_ratios, f_divergence, f_alpha)
    rejected_scores = _f_scores(rejected_ratios, f_divergence, f_alpha)
    delta = chosen_scores - rejected_scores

    loss = torch.zeros((), dtype=chosen_logps.dtype, device=chosen_logps.device)
    terms = {}
    for name, weight in zip(names, weights):
        if name == "sigmoid":  # DPO: -log sigmoid(beta * margin)
            per_pair = -F.logsigmoid(beta * delta)
        elif name == "hinge":  # SLiC
            per_pair = torch.relu(1 - beta * delta)
        elif name in ("ipo", "sigmoid_norm"):  # the scores per completion token
            normed = chosen_scores / chosen_counts.clamp(min=1.0) - rejected_scores / rejected_counts.clamp(min=1.0)
            per_pair = ((normed - 1 / (2 * beta)) ** 2 if name == "ipo" else -F.logsigmoid(beta * normed))
        elif name == "exo_pair":  # KL(softmax over the pair || (1 - eps, eps)), EXO eq. 16
            z = beta * delta
            per_pair = (torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-ls))
                        + torch.sigmoid(-z) * (F.logsigmoid(-z) - math.log(ls)))
        elif name == "nca_pair":
            per_pair = (-F.logsigmoid(beta * chosen_ratios) - 0.5 * F.logsigmoid(-beta * chosen_ratios)
                        - 0.5 * F.logsigmoid(-beta * rejected_ratios))
        elif name == "robust":  # robust DPO: unbiased under a flip rate of label_smoothing
            per_pair = (-(1 - ls) * F.logsigmoid(beta * delta) + ls * F.logsigmoid(-beta * delta)) / (1 - 2 * ls)
        elif name == "bco_pair":
            per_pair = -F.logsigmoid(beta * chosen_ratios) - F.logsigmoid(-beta * rejected_ratios)
        elif name == "sppo_hard":  # SPPO with the winner's probability 1, the loser's 0
            per_pair = (chosen_ratios - 0.5 / beta) ** 2 + (rejected_ratios + 0.5 / beta) ** 2
        elif name in ("aot", "aot_unpaired"):  # optimal transport: the sorted margins of the batch
            if name == "aot":
                gap = (torch.sort(chosen_logps - rejected_logps, dim=0)[0]
                       - torch.sort(ref_chosen_logps - ref_rejected_logps, dim=0)[0])
            else:
                gap = torch.sort(chosen_ratios, dim=0)[0] - torch.sort(rejected_ratios, dim=0)[0]
            per_pair = -(1 - ls) * F.logsigmoid(beta * gap) - ls * F.logsigmoid(-beta * gap)
        elif name == "apo_zero":  # APO eq. 7: chosen up, rejected down
            per_pair = 1 - torch.sigmoid(beta * chosen_ratios) + torch.sigmoid(beta * rejected_ratios)
        elif name == "apo_down":  # APO eq. 8: chosen down, rejected down more
            per_pair = torch.sigmoid(beta * chosen_ratios) + 1 - torch.sigmoid(beta * (chosen_ratios - rejected_ratios))
        elif name == "discopop":  # DiscoPOP eq. 5: logistic and exponential losses mixed by sigmoid(z / tau)
            z = beta * delta
            mix = torch.sigmoid(z / discopop_tau)
            per_pair = -F.logsigmoid(z) * (1 - mix) + torch.exp(-z) * mix
        else:  # "sft": the chosen completions' NLL per token, one value for the batch
            per_pair = (-chosen_logps.sum() / chosen_counts.sum()).expand(chosen_logps.shape[0])
        terms[name] = per_pair.mean()
        loss = loss + terms[name] * weight

    chosen_rewards = beta * chosen_ratios.detach()
    rejected_rewards = beta * rejected_ratios.detach()
    return PreferenceLoss(loss, _pair_metrics(chosen_rewards, rejected_rewards, chosen_logps, rejected_logps),
                          terms)


def _pair_metrics(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, chosen_logps: torch.Tensor,
                  rejected_logps: torch.Tensor) -> dict[str, torch.Tensor]:
    """The metrics every paired trainer of TRL logs, as this batch's means."""
    return {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "logps/chosen": chosen_logps.detach().mean(),
        "logps/rejected": rejected_logps.detach().mean(),
    }


# --- CPO and SimPO (no reference) ------------------------------------------------------------------------

def cpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, chosen_counts: torch.Tensor,
             rejected_counts: torch.Tensor, *, loss_type: str = "sigmoid", beta: float = 0.1,
             label_smoothing: float = 0.0, simpo_gamma: float = 0.5, cpo_alpha: float = 1.0,
             alpha: float = 0.0) -> PreferenceLoss:
    """TRL 1.16's CPOTrainer loss: a reference-free preference loss on the policy's log-probs plus
    `cpo_alpha` times the NLL of the chosen completions (their mean token NLL over the batch).

    Takes summed log-probs and token counts; "simpo" and "ipo" use the mean per token (length-normalised),
    "sigmoid" and "hinge" the sums, as TRL. SimPO: -log sigmoid(beta * (chosen - rejected) - gamma), with
    label_smoothing mixing in the flipped term; the SimPO paper's recipe has cpo_alpha 0. `alpha` != 0 is
    AlphaPO: rewards (1 - p^-alpha) / alpha of the sequence probability p instead of log p. Metrics: rewards
    are beta times the (averaged) log-probs, logps/* the (averaged) log-probs, nll_loss (0 with cpo_alpha 0).
    """
    check_choice(loss_type, CPO_LOSS_TYPES, "CPO loss type")
    beta = check_beta(beta)
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    average = loss_type in ("ipo", "simpo")
    chosen = chosen_logps / chosen_counts if average else chosen_logps
    rejected = rejected_logps / rejected_counts if average else rejected_logps
    if alpha != 0.0:  # AlphaPO's reward of the sequence probability
        chosen_scores = (1 - torch.exp(chosen).pow(-alpha)) / alpha
        rejected_scores = (1 - torch.exp(rejected).pow(-alpha)) / alpha
    else:
        chosen_scores, rejected_scores = chosen, rejected
    margin = chosen_scores - rejected_scores
    if loss_type in ("sigmoid", "simpo"):
        if loss_type == "simpo":
            margin = margin - simpo_gamma / beta  # beta * margin - gamma inside the sigmoid
        losses = -F.logsigmoid(beta * margin) * (1 - label_smoothing) - F.logsigmoid(-beta * margin) * label_smoothing
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * margin)
    else:  # "ipo", on the averaged log-probs
        losses = (margin - 1 / (2 * beta)) ** 2
    if cpo_alpha == 0:
        nll = torch.zeros((), dtype=chosen_logps.dtype, device=chosen_logps.device)
    else:
        nll = -chosen_logps.sum() / chosen_counts.sum()
    loss = losses.mean() + cpo_alpha * nll
    metrics = _pair_metrics(beta * chosen_scores.detach(), beta * rejected_scores.detach(), chosen, rejected)
    metrics["nll_loss"] = nll.detach()
    return PreferenceLoss(loss, metrics)


# --- ORPO (no reference) ---------------------------------------------------------------------------------

def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0 without cancellation: log1p(-exp(x)) below -log 2, log(-expm1(x)) above."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, chosen_counts: torch.Tensor,
              rejected_counts: torch.Tensor, chosen_nll: torch.Tensor, *, beta: float = 0.1) -> PreferenceLoss:
    """TRL 1.16's ORPOTrainer loss: chosen_nll - beta * mean(log sigmoid(log odds(chosen) - log odds(rejected))),
    the odds of a completion being p / (1 - p) with p its per-token mean probability (exp of the averaged
    log-prob: summed `*_logps` over `*_counts`).

    `chosen_nll` is the SFT term as TRL spans it: the mean token NLL of the chosen sequences over prompt AND
    completion (every attended token after the first), not over the completion alone, so it needs the
    prompt's token log-probs too (labels = input ids where attended, shifted). Metrics: rewards are beta
    times the averaged log-probs; nll_loss; log_odds_ratio (the mean log sigmoid of the log-odds difference)
    and log_odds_chosen (the mean log-odds difference itself), named as TRL names them.
    """
    beta = check_beta(beta)
    chosen = (chosen_logps / chosen_counts).float()
    rejected = (rejected_logps / rejected_counts).float()
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    ratio = F.logsigmoid(log_odds)
    loss = chosen_nll - (beta * ratio).mean()
    metrics = _pair_metrics(beta * chosen.detach(), beta * rejected.detach(), chosen, rejected)
    metrics.update({"nll_loss": chosen_nll.detach(), "log_odds_ratio": ratio.detach().mean(),
                    "log_odds_chosen": log_odds.detach().mean()})
    return PreferenceLoss(loss, metrics)


# --- KTO (unpaired) --------------------------------------------------------------------------------------

def kto_kl_estimate(kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor) -> torch.Tensor:
    """The KL term's estimate before its clamp: the mean of policy - reference log-probs of the mismatched
    completions, detached (no gradient flows through it). Across ranks TRL averages these means, then
    clamps at 0 (in kto_loss): all-reduce this value, not the clamped one."""
    return (kl_logps - ref_kl_logps).mean().detach()


def kto_loss(logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor,
             kl: torch.Tensor | None = None, *, loss_type: str = "kto", beta: float = 0.1,
             desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> PreferenceLoss:
    """TRL 1.16's KTOTrainer loss on unpaired completions: `logps`, `ref_logps` [N] summed log-probs,
    `desirable` [N] bool. "kto": 1 - sigmoid(beta * (ratio - z)) for desirable completions, 1 - sigmoid(beta
    * (z - ratio)) for undesirable ones, with z = max(kl, 0) (`kl` from kto_kl_estimate, required);
    "apo_zero_unpaired": 1 - sigmoid(beta * ratio) and sigmoid(beta * ratio), no KL term. Each side times its
    weight; the loss is the mean over all N (nan-skipping, as TRL). Metrics: kl (the clamped value),
    rewards/* and logps/* as sums over each side / its count, present only for a side this batch has, and
    rewards/margins when it has both.
    """
    check_choice(loss_type, KTO_LOSS_TYPES, "KTO loss type")
    beta = check_beta(beta)
    desirable = desirable.to(torch.bool)
    if loss_type == "kto":
        if kl is None:
            raise ValueError("the 'kto' loss needs kl (kto_kl_estimate of the mismatched completions)")
        z = kl.detach().clamp(min=0)
    else:
        z = torch.zeros((), dtype=logps.dtype, device=logps.device)
    ratios = logps - ref_logps
    chosen, rejected = ratios[desirable], ratios[~desirable]
    if loss_type == "kto":
        chosen_losses = 1 - torch.sigmoid(beta * (chosen - z))
        rejected_losses = 1 - torch.sigmoid(beta * (z - rejected))
    else:
        chosen_losses = 1 - torch.sigmoid(beta * chosen)
        rejected_losses = torch.sigmoid(beta * rejected)
    losses = torch.cat((desirable_weight * chosen_losses, undesirable_weight * rejected_losses))
    metrics = {"kl": z.detach()}
    for side, mask, values in (("chosen", desirable, chosen), ("rejected", ~desirable, rejected)):
        count = int(mask.sum())
        if count:
            metrics[f"rewards/{side}"] = (beta * values.detach()).nansum() / count
            metrics[f"logps/{side}"] = logps[mask].detach().nansum() / count
    if "rewards/chosen" in metrics and "rewards/rejected" in metrics:
        metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return PreferenceLoss(losses.nanmean(), metrics)


# --- reward model ----------------------------------------------------------------------------------------

def reward_loss(rewards_chosen: torch.Tensor, rewards_rejected: torch.Tensor, margin: torch.Tensor | None = None,
                center_rewards_coefficient: float | None = None) -> PreferenceLoss:
    """TRL 1.16's RewardTrainer loss, Bradley-Terry: mean of -log sigmoid(r_chosen - r_rejected - margin)
    (margin per pair, optional), plus center_rewards_coefficient * mean((r_chosen + r_rejected)^2), which
    keeps the rewards centred on 0 (Eisenstein et al.). Metrics as TRL names them: accuracy, margin,
    min_reward, mean_reward, max_reward (the last three over chosen and rejected together)."""
    gap = rewards_chosen - rewards_rejected
    loss = -F.logsigmoid(gap if margin is None else gap - margin).mean()
    if center_rewards_coefficient is not None:
        loss = loss + center_rewards_coefficient * torch.mean((rewards_chosen + rewards_rejected) ** 2)
    every = torch.cat((rewards_chosen.detach(), rewards_rejected.detach()))
    metrics = {"accuracy": (gap > 0).float().mean().detach(), "margin": gap.detach().mean(),
               "min_reward": every.min(), "mean_reward": every.mean(), "max_reward": every.max()}
    return PreferenceLoss(loss, metrics)
