"""Preference objectives in the model's forward (train.objective dpo, simpo, orpo, kto): the one place that
maps an objective to its loss call in dstrain.models.preference_loss.

The built-in GPT and an hf: model get, from `attach` (called by build_model), a `logps_head` submodule and a
`preference` object. Their forward(batch) then hands a preference batch (one with "example_ids", see
dstrain/data/preference.py) to `PreferenceObjective`, which
- runs the decoder body (a forward that stops before the head) and `LogpsHead`: per-token log-probs through
  preference_loss.head_token_logps, never the whole fp32 logits (an hf: model whose forward cannot be split
  into body and head gives its logits to token_logps instead);
- sums them per completion (shift_segment_ids, segment_logps);
- computes the reference's log-probs without gradient: the same module under peft's disable_adapter()
  ("adapters_off"), or a frozen copy of the starting weights set by the rank as `reference` ("model"),
  called through its module so that ZeRO-3's hooks gather its partitions; DPO with "precomputed" reads
  each pair's sums from the batch (ref_chosen, ref_rejected: dstrain.rank.precomputed);
- returns the objective's loss: the batch's mean per pair (KTO: per example), as TRL computes it for one
  micro batch. The train loop weights it by the batch's share of the step's pairs (see dstrain.rank.loop).
The batch's metrics (TRL's names) are kept in `last_metrics` as (value, weight) for the loop to average.

Under ZeRO-3 the head's weight is gathered around LogpsHead's forward as for chunked_loss.LMHeadLoss.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from dstrain.config.preference import DEFAULT_LOSS, dpo_loss_terms
from dstrain.config.schema import RunConfig
from dstrain.errors import UserError
from dstrain.models import preference_loss as pl

IGNORE_INDEX = -100
PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected")
# The metrics each objective logs (a fixed list, so that ranks can add them up in one all-reduce).
METRICS = {"dpo": PAIR_METRICS, "simpo": (*PAIR_METRICS, "nll_loss"),
           "orpo": (*PAIR_METRICS, "nll_loss", "log_odds_ratio", "log_odds_chosen"),
           "kto": ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "kl"),
           # reward_loss's names (TRL's RewardTrainer); min/max are no means over pairs, so not averaged here
           "reward": ("accuracy", "margin", "mean_reward")}
SUPPORTED = tuple(METRICS)


class LogpsRequest(NamedTuple):
    """What a reference module's forward takes instead of a batch: rows, their positions and the targets
    aligned with them (-100: not scored); it returns the per-token log-probs [rows, T]."""
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor


class LogpsHead(nn.Module):
    """The LM head's per-token log-probs as a module of the model: forward(hidden, targets) is
    head_token_logps(hidden, head.weight, targets, head.bias, chunk). The head stays where the model keeps it
    (held outside the module tree: no second name in state_dict); under ZeRO-3 its weight is registered as
    this module's external parameter, so DeepSpeed gathers it around this forward and its backward."""

    def __init__(self, head: nn.Linear, chunk: int):
        super().__init__()
        self._head = (head,)
        self.chunk = chunk
        for param in (head.weight, head.bias):
            if param is not None and hasattr(param, "ds_id"):
                import deepspeed
                deepspeed.zero.register_external_parameter(self, param)

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        head = self._head[0]
        return pl.head_token_logps(hidden, head.weight, targets, head.bias, self.chunk)


def attach(model: nn.Module, config: RunConfig) -> None:
    """Make `model` (the built-in GPT or an hf: CausalLM) compute train.objective's loss on preference
    batches: a LogpsHead (where the model splits into body and head) and a PreferenceObjective."""
    objective = config.train.objective
    if objective not in SUPPORTED:
        raise UserError.single(f"train.objective {objective} is not trained by dstrain's loop yet",
                               "train.objective", f"use one of {', '.join(SUPPORTED)}")
    chunk = config.train.loss_chunk_tokens
    if objective == "reward":  # a score head, no log-probs (config.objective refuses anything but hf: models)
        if not hasattr(model, "scores"):
            raise UserError.single("train.objective reward trains an hf: model (a sequence classifier)",
                                   "model.name", "use model.name: hf:<directory or hub id>")
    elif hasattr(model, "enable_logps"):  # the built-in GPT, an hf: CausalLM
        model.enable_logps(chunk)
    else:
        raise UserError.single(f"train.objective {objective} trains the built-in gpt or an hf: model; "
                               f"{config.model.name!r} is an entry point", "model.name",
                               "use model.name: gpt or hf:<directory or hub id>")
    model.preference = PreferenceObjective(config)


def last_token_values(values: torch.Tensor, example_ids: torch.Tensor, labels: torch.Tensor,
                      num_segments: int) -> torch.Tensor:
    """values [rows, T] at each segment's last labelled token [num_segments]: a reward model's score of a
    completion is read where the completion ends (TRL: the last token that is not padding; here a packed
    row's segments each at their own end)."""
    segments = torch.where(labels != IGNORE_INDEX, example_ids, -1).reshape(-1)
    keep = segments >= 0
    at = torch.arange(segments.numel(), device=segments.device)
    last = torch.full((num_segments,), -1, dtype=torch.long, device=segments.device)
    last = last.scatter_reduce(0, segments[keep].long(), at[keep], reduce="amax")
    if bool((last < 0).any()):
        raise RuntimeError("a completion of the batch has no labelled token")
    return values.reshape(-1)[last]


def units_in(batch: dict) -> int:
    """The pairs (KTO: examples) of a preference batch: what its loss is a mean over."""
    return int(batch["margin"].shape[0]) if "margin" in batch else int(batch["desirable"].shape[0])


class PreferenceObjective:
    """train.objective's loss on a preference batch, with the preference section's settings (see the
    module docstring). `reference` is the frozen copy for preference.reference "model" (set by the rank)."""

    def __init__(self, config: RunConfig):
        p = config.preference
        self.objective = config.train.objective
        self.mode = p.reference
        self.beta, self.label_smoothing = p.beta, p.label_smoothing
        self.loss = p.loss if p.loss is not None else DEFAULT_LOSS.get(self.objective)
        if self.objective == "dpo":
            self.dpo_names, self.dpo_weights = dpo_loss_terms(self.loss, p.loss_weights, p.sft_weight)
        self.sft_weight, self.simpo_gamma = p.sft_weight, p.simpo_gamma
        self.kto_weights = (p.kto_desirable_weight, p.kto_undesirable_weight)
        self.center_rewards_coefficient = p.center_rewards_coefficient
        self.reference: nn.Module | None = None
        self.last_metrics: dict[str, tuple[torch.Tensor, float]] = {}

    # --- log-probs ---------------------------------------------------------------------------------------

    def targets_of(self, batch: dict, prefix: str = "", every_token: bool = False):
        """(targets aligned with the logits, segment id per position) of the rows under `prefix` ("" or
        "kl_"): the completions' tokens, or with `every_token` each example's tokens after its first."""
        ids, examples = batch[prefix + "input_ids"], batch[prefix + "example_ids"]
        labels = torch.where(examples >= 0, ids, IGNORE_INDEX) if every_token else batch[prefix + "labels"]
        segments = pl.shift_segment_ids(examples, labels)
        return torch.where(segments >= 0, pl.shift_labels(labels), IGNORE_INDEX), segments

    def _reference_logps(self, model: nn.Module, batch: dict, targets: torch.Tensor, prefix: str = "") -> torch.Tensor:
        """The reference's per-token log-probs, without gradient."""
        ids, positions = batch[prefix + "input_ids"], batch[prefix + "position_ids"]
        with torch.no_grad():
            if self.mode == "adapters_off":
                with model.adapters_disabled():
                    return model.token_logps(ids, positions, targets)
            if self.reference is None:
                raise RuntimeError("preference.reference model: the rank did not set the reference copy")
            return self.reference(LogpsRequest(ids, positions, targets))

    def _sums(self, model, batch, prefix="", every_token=False, grad=True, reference=False):
        """(summed log-probs, token counts, per-token log-probs) of the rows under `prefix`, from the policy
        (without gradient where `grad` is False) or the reference; ORPO reads the per-token ones again."""
        count = int(batch["desirable"].shape[0])
        targets, segments = self.targets_of(batch, prefix, every_token)
        if reference:
            logps = self._reference_logps(model, batch, targets, prefix)
        else:
            with contextlib.nullcontext() if grad else torch.no_grad():
                logps = model.token_logps(batch[prefix + "input_ids"], batch[prefix + "position_ids"], targets)
        sums, counts = pl.segment_logps(logps, segments, count)
        return sums, counts, logps

    def sums_without_grad(self, model: nn.Module, batch: dict) -> torch.Tensor:
        """Summed log-probs of the batch's rows (chosen, then rejected), without gradient, through the model's
        forward (a LogpsRequest), as a reference copy is called: under ZeRO-3 the module hooks then gather
        the weights, which a direct token_logps call outside a forward would find partitioned
        (dstrain.rank.precomputed's pass)."""
        targets, segments = self.targets_of(batch)
        with torch.no_grad():
            logps = model(LogpsRequest(batch["input_ids"], batch["position_ids"], targets))
        sums, _ = pl.segment_logps(logps, segments, int(batch["desirable"].shape[0]))
        return sums

    # --- the loss --------------------------------------------------------------------------------------

    def __call__(self, model: nn.Module, batch: dict) -> torch.Tensor:
        """The objective's loss on `batch` (its mean per pair, KTO per example); metrics in last_metrics."""
        if self.objective == "kto":
            return self._kto(model, batch)
        pairs = units_in(batch)
        if self.objective == "reward":
            return self._reward(model, batch, pairs)
        if self.objective == "dpo":
            if self.mode == "precomputed":  # computed once before training (dstrain.rank.precomputed)
                if "ref_chosen" not in batch:
                    raise RuntimeError("preference.reference precomputed: the batch carries no ref_chosen")
                ref = torch.cat((batch["ref_chosen"], batch["ref_rejected"])).float()
            else:
                ref, _, _ = self._sums(model, batch, reference=True)  # first, as TRL: the policy's graph then follows
            sums, counts, _ = self._sums(model, batch)
            out = pl.dpo_loss(sums[:pairs], sums[pairs:], ref[:pairs], ref[pairs:], loss_type=list(self.dpo_names),
                              loss_weights=list(self.dpo_weights), beta=self.beta,
                              label_smoothing=self.label_smoothing, chosen_counts=counts[:pairs],
                              rejected_counts=counts[pairs:])
        elif self.objective == "simpo":
            sums, counts, _ = self._sums(model, batch)
            out = pl.cpo_loss(sums[:pairs], sums[pairs:], counts[:pairs], counts[pairs:], loss_type=self.loss,
                              beta=self.beta, label_smoothing=self.label_smoothing, simpo_gamma=self.simpo_gamma,
                              cpo_alpha=self.sft_weight)
        else:  # orpo: one pass scores every token; the completions' sums and the chosen rows' NLL come from it
            every, every_counts, logps = self._sums(model, batch, every_token=True)
            _, segments = self.targets_of(batch)
            sums, counts = pl.segment_logps(logps, segments, int(batch["desirable"].shape[0]))
            chosen_nll = -every[:pairs].sum() / every_counts[:pairs].sum()
            out = pl.orpo_loss(sums[:pairs], sums[pairs:], counts[:pairs], counts[pairs:], chosen_nll, beta=self.beta)
        self.last_metrics = {name: (out.metrics[name], float(pairs)) for name in METRICS[self.objective]}
        return out.loss

    def _reward(self, model: nn.Module, batch: dict, pairs: int) -> torch.Tensor:
        """Bradley-Terry on the scores at each completion's last token (its eos), with the pairs' margins (0
        where a pair has none, which is the loss without one) and center_rewards_coefficient."""
        rewards = last_token_values(model.scores(batch["input_ids"], batch["position_ids"]), batch["example_ids"],
                                    batch["labels"], 2 * pairs)
        out = pl.reward_loss(rewards[:pairs], rewards[pairs:], batch["margin"].to(rewards.dtype),
                             self.center_rewards_coefficient)
        self.last_metrics = {name: (out.metrics[name], float(pairs)) for name in METRICS["reward"]}
        return out.loss

    def _kto(self, model: nn.Module, batch: dict) -> torch.Tensor:
        """KTO on unpaired examples; the KL term from the mismatched rows (policy and reference, no gradient),
        averaged over the ranks before its clamp, as TRL gathers it."""
        desirable = batch["desirable"].to(torch.bool)
        kl = None
        if self.loss == "kto":
            kl_policy, _, _ = self._sums(model, batch, prefix="kl_", grad=False)
            kl_reference, _, _ = self._sums(model, batch, prefix="kl_", reference=True)
            kl = pl.kto_kl_estimate(kl_policy, kl_reference)
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(kl)
                kl = kl / dist.get_world_size()
        ref, _, _ = self._sums(model, batch, reference=True)
        sums, _, _ = self._sums(model, batch)
        out = pl.kto_loss(sums, ref, desirable, kl, loss_type=self.loss, beta=self.beta,
                          desirable_weight=self.kto_weights[0], undesirable_weight=self.kto_weights[1])
        sides = {"chosen": float(desirable.sum()), "rejected": float((~desirable).sum())}
        zero = torch.zeros((), device=sums.device)
        self.last_metrics = {"kl": (out.metrics["kl"], 1.0)}
        for side, weight in sides.items():
            for kind in ("rewards", "logps"):
                self.last_metrics[f"{kind}/{side}"] = (out.metrics.get(f"{kind}/{side}", zero), weight)
        return out.loss
