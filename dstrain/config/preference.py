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

# preference.reference: where the reference log-probs come from. "auto" picks adapters_off under LoRA, a
# frozen copy of the model otherwise; "none" only for objectives that need no reference.
REFERENCE_MODES = ("auto", "adapters_off", "model", "precomputed", "none")
OBJECTIVES_WITHOUT_REFERENCE = ("lm", "simpo", "orpo", "reward")


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


def check_choice(value: str, accepted: Sequence[str], what: str) -> str:
    """`value` if it is one of `accepted`, else ValueError naming them."""
    if value not in accepted:
        raise ValueError(f"unknown {what} {value!r}: accepted are {_names(accepted)}")
    return value
