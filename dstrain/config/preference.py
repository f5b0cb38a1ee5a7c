"""The names a preference-training config may use (train.objective, preference.loss, preference.reference)
and the checks of a loss list, its weights and beta: one table, read by the config schema and by the loss
functions (dstrain.models.preference_loss). No torch import: resolution runs before any rank starts.

The loss names are TRL 1.16's (DPOConfig.loss_type, CPOConfig.loss_type, KTOConfig.loss_type), so that a
TRL recipe's `loss_type` reads the same here; each loss's definition is in dstrain.models.preference_loss.
"""

from __future__ import annotations

from collections.abc import Sequence

# train.objective: "lm" is next-token training; the others are preference objectives.
OBJECTIVES = ("lm", "dpo", "simpo", "orpo", "kto", "reward")

# preference.loss for objective "dpo": one name or a list, summed with preference.loss_weights (TRL's
# DPOTrainer). "sft" is the NLL of the chosen completions (the MPO / RPO term), weighted like the others.
DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
                  "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")
# The DPO losses TRL allows with an f-divergence other than reverse KL (the others need the log Z(x) term to
# cancel in the chosen - rejected difference).
F_DIVERGENCE_LOSS_TYPES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft")
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
# The DPO losses that read label_smoothing (TRL 1.16: the others ignore it, the plain sigmoid included).
LABEL_SMOOTHING_LOSS_TYPES = ("exo_pair", "robust", "aot", "aot_unpaired")

# Objective "simpo" (and CPO) is TRL's CPOTrainer: no reference model.
CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")
# Objective "kto" is TRL's KTOTrainer: unpaired completions, each desirable or not.
KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")

# preference.reference precomputed (dstrain.rank.precomputed) serves DPO. KTO's KL term scores each completion
# after another example's prompt of the same micro batch, which changes every epoch: `dstrain run` refuses it.
PRECOMPUTED_OBJECTIVES = ("dpo",)
NOT_IMPLEMENTED_REFERENCE = ("preference.reference precomputed is implemented for train.objective dpo only (KTO's KL "
                             "term pairs completions with other prompts of the same micro batch, which changes "
                             "every epoch, so it cannot be computed once): `dstrain run` refuses it")

# preference.loss per objective: the names it accepts and the one it takes when preference.loss is unset.
# ORPO and the reward model have one loss each (no preference.loss).
LOSS_TYPES = {"dpo": DPO_LOSS_TYPES, "simpo": CPO_LOSS_TYPES, "kto": KTO_LOSS_TYPES}
DEFAULT_LOSS = {"dpo": "sigmoid", "simpo": "simpo", "kto": "kto"}
# preference.sft_weight: the weight of the chosen completions' NLL. DPO: TRL 1.16's extra "sft" loss type
# (RPO / MPO); SimPO / CPO: CPOConfig.cpo_alpha. ORPO's NLL term is part of its loss, KTO and the reward
# model have none.
SFT_WEIGHT_OBJECTIVES = ("dpo", "simpo")
# Objectives trained on pairs (chosen and rejected completions of one prompt); "kto" reads unpaired
# completions, each labelled desirable or not (pairs are split into one of each, as TRL's
# unpair_preference_dataset does).
PAIRED_OBJECTIVES = ("dpo", "simpo", "orpo", "reward")
# Which objectives read each key of the preference section; a key set for another objective is ignored,
# with a warning (the reference's own rules are in dstrain.config.objective).
READ_BY = {"loss": ("dpo", "simpo", "kto"), "loss_weights": ("dpo",), "beta": ("dpo", "simpo", "orpo", "kto"),
           "label_smoothing": ("dpo", "simpo"), "reference": ("dpo", "kto"), "sft_weight": SFT_WEIGHT_OBJECTIVES,
           "simpo_gamma": ("simpo",), "kto_desirable_weight": ("kto",), "kto_undesirable_weight": ("kto",),
           "center_rewards_coefficient": ("reward",)}

# preference.reference: where the reference log-probs come from. "auto" picks adapters_off under LoRA, a
# frozen copy of the model otherwise; "none" only for objectives that need no reference.
REFERENCE_MODES = ("auto", "adapters_off", "model", "precomputed", "none")
OBJECTIVES_WITHOUT_REFERENCE = ("lm", "simpo", "orpo", "reward")


def auto_reference(objective: str, lora: bool) -> str:
    """What preference.reference "auto" means: none where the objective reads no reference, the base model
    under the adapters (adapters switched off) with LoRA, else a frozen copy of the model."""
    if objective in OBJECTIVES_WITHOUT_REFERENCE:
        return "none"
    return "adapters_off" if lora else "model"


def dpo_loss_terms(loss: str | Sequence[str], weights: Sequence[float] | None,
                   sft_weight: float) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """The DPO loss list with sft_weight as TRL 1.16 spells RPO / MPO: an extra "sft" term of that weight
    (added to a listed "sft" term's weight where the list has one). ValueError as check_loss_types."""
    names, weights = check_loss_types(loss, weights, DPO_LOSS_TYPES)
    if not sft_weight:
        return names, weights
    if "sft" in names:
        at = names.index("sft")
        return names, weights[:at] + (weights[at] + sft_weight,) + weights[at + 1:]
    return names + ("sft",), weights + (float(sft_weight),)


def _names(accepted: Sequence[str]) -> str:
    return ", ".join(accepted)


def check_loss_types(loss: str | Sequence[str], weights: Sequence[float] | None = None,
                     accepted: Sequence[str] = DPO_LOSS_TYPES) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """The loss names as a tuple and their weights (1.0 each when `weights` is None). Raises ValueError,
    naming what is accepted, for an unknown name, an empty list, or a weights list of another length."""
    names = (loss,) if isinstance(loss, str) else tuple(loss)
    if not names:
        raise ValueError(f"the loss list is empty: give one or more of {_names(accepted)}")
    unknown = [name for name in names if name not in accepted]
    if unknown:
        raise ValueError(f"unknown loss type {', '.join(map(repr, unknown))}: accepted are {_names(accepted)}")
    if weights is None:
        return names, (1.0,) * len(names)
    weights = tuple(float(w) for w in weights)
    if len(weights) != len(names):
        raise ValueError(f"{len(weights)} loss weights for {len(names)} loss types ({_names(names)}): "
                         "give one weight per loss type, in the same order")
    return names, weights


def check_beta(beta: float) -> float:
    """beta as a float; ValueError unless it is a finite number > 0 (every loss divides by it or scales by it)."""
    value = float(beta)
    if not value > 0 or value == float("inf"):
        raise ValueError(f"beta must be a finite number > 0, got {beta!r}")
    return value


def check_label_smoothing(names: Sequence[str], label_smoothing: float) -> None:
    """ValueError unless label_smoothing suits every loss in `names`: in [0, 1]; robust divides by
    1 - 2 * label_smoothing, exo_pair takes the log of it and of 1 - it."""
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if "robust" in names and not label_smoothing < 0.5:
        raise ValueError(f"the 'robust' loss divides by 1 - 2 * label_smoothing: label_smoothing must be in "
                         f"[0, 0.5), got {label_smoothing}")
    if "exo_pair" in names and not 0.0 < label_smoothing < 1.0:
        raise ValueError(f"the 'exo_pair' loss takes log(label_smoothing) and log(1 - label_smoothing): "
                         f"label_smoothing must be in (0, 1), got {label_smoothing} (the EXO paper uses 1e-3)")


def check_choice(value: str, accepted: Sequence[str], what: str) -> str:
    """`value` if it is one of `accepted`, else ValueError naming them."""
    if value not in accepted:
        raise ValueError(f"unknown {what} {value!r}: accepted are {_names(accepted)}")
    return value


def kto_mismatched_order(batch_size: int) -> list[int]:
    """For KTO's KL term: example i is paired with the completion of example i - 1 of its batch (the first with
    the last), as TRL's KTO data preparation rotates them batch by batch. Here, beside the names, so that
    the data layer (which builds the mismatched rows) and the loss read one rule."""
    return [batch_size - 1, *range(batch_size - 1)] if batch_size > 0 else []
