"""train.objective and the preference section, checked at resolution (before any rank starts): every
problem reported together with its key, as the rest of resolution does, and preference.reference "auto"
decided. The names and the per-loss checks are dstrain.config.preference's (one table); this module only
says where in the config each one applies. No torch import."""

from __future__ import annotations

from dstrain.config.layers import PRESET_RANK, Merged
from dstrain.config.preference import (DEFAULT_LOSS, LOSS_TYPES, NOT_IMPLEMENTED_REFERENCE,
                                       OBJECTIVES_WITHOUT_REFERENCE, PRECOMPUTED_OBJECTIVES,
                                       READ_BY, auto_reference, check_beta, check_label_smoothing,
                                       check_loss_types)
from dstrain.config.schema import RunConfig
from dstrain.errors import Problem

PREFERENCE_FORMAT = "preference"


def check_objective(config: RunConfig, merged: Merged, problems: list[Problem], warnings: list[str],
                    notes: dict[str, str]) -> None:
    """The objective's rules: its data format, loss names and weights, beta, label smoothing, reference,
    micro batch (KTO) and model (reward); preference keys the objective does not read are warnings."""
    objective, pref, where = config.train.objective, config.preference, merged.where
    user_set = [key for key in READ_BY if merged.source_of(f"preference.{key}").rank > PRESET_RANK]
    if objective == "lm":
        if config.data.format == PREFERENCE_FORMAT:
            problems.append(Problem("data.format preference holds chosen and rejected completions, which "
                                    "train.objective lm (next-token training) does not read", where("data.format"),
                                    "set train.objective to dpo, simpo, orpo, kto or reward, or use an SFT format"))
        if user_set:
            warnings.append(f"{where('preference')}: ignored with train.objective lm ({', '.join(user_set)} set); "
                            "set train.objective to a preference objective, or remove the section")
        return
    for key in user_set:
        if objective not in READ_BY[key]:
            warnings.append(f"{where(f'preference.{key}')}: train.objective {objective} does not read it (it is read "
                            f"by {', '.join(READ_BY[key])}); remove it")
    if config.data.format != PREFERENCE_FORMAT:
        problems.append(Problem(f"train.objective {objective} trains on preference data, but data.format is "
                                f"{config.data.format!r}", where("data.format"),
                                "set data.format: preference, with rows of prompt/chosen/rejected (or KTO's "
                                "prompt/completion/label) in jsonl, json, parquet or datasets files"))
    if objective in LOSS_TYPES:
        _check_loss(config, merged, problems)
    if objective != "reward":
        try:
            check_beta(pref.beta)
        except ValueError as err:
            problems.append(Problem(str(err), where("preference.beta"),
                                    "e.g. preference.beta: 0.1 (TRL's default; SimPO's recipes use 2-10)"))
    _resolve_reference(config, merged, problems, notes)
    if (pref.reference == "precomputed" and objective not in OBJECTIVES_WITHOUT_REFERENCE
            and objective not in PRECOMPUTED_OBJECTIVES):
        warnings.append(f"{where('preference.reference')}: {NOT_IMPLEMENTED_REFERENCE}; use adapters_off (LoRA) or "
                        "model")
    if objective != "reward" and not (config.model.name == "gpt" or config.model.name.startswith("hf:")):
        problems.append(Problem(f"train.objective {objective} trains the built-in gpt or an \"hf:\" model (it needs "
                                f"the model's hidden states and LM head); {config.model.name!r} is an entry point",
                                where("model.name"), "set model.name: gpt or hf:<directory or hub id>"))
    if config.train.compile:
        problems.append(Problem(f"train.objective {objective}: train.compile is not supported with preference "
                                "objectives yet (their forward runs the model more than once)", where("train.compile"),
                                "set train.compile: false"))
    loss = pref.loss if pref.loss is not None else DEFAULT_LOSS.get(objective)
    names = [loss] if isinstance(loss, str) else loss or []
    if objective == "kto" and "kto" in names and config.train.micro_batch_size < 2:
        problems.append(Problem("the KTO loss estimates its KL term from each completion paired with another "
                                "example's prompt in the same micro batch, which needs at least 2 examples (TRL "
                                "requires a batch > 1)", where("train.micro_batch_size"),
                                "set train.micro_batch_size to 2 or more, or preference.loss: apo_zero_unpaired "
                                "(no KL term)"))
    if objective == "reward" and not config.model.name.startswith("hf:"):
        problems.append(Problem(f"train.objective reward trains a Hugging Face model with a scalar head (a sequence "
                                f"classifier); model {config.model.name!r} is not an \"hf:\" model",
                                where("model.name"), "set model.name: hf:<directory or hub id>"))
    if config.train.sequence_parallel > 1:
        problems.append(Problem(f"train.objective {objective} sums each completion's log-probs over its tokens, "
                                "which sequence parallelism spreads over ranks (not supported)",
                                where("train.sequence_parallel"), "set train.sequence_parallel: 1"))


def _check_loss(config: RunConfig, merged: Merged, problems: list[Problem]) -> None:
    """preference.loss (names accepted by the objective), loss_weights (one per name) and label_smoothing."""
    objective, pref, where = config.train.objective, config.preference, merged.where
    accepted = LOSS_TYPES[objective]
    loss = pref.loss if pref.loss is not None else DEFAULT_LOSS[objective]
    try:
        names, _ = check_loss_types(loss, None, accepted)
    except ValueError as err:
        problems.append(Problem(f"{err} (train.objective {objective})", where("preference.loss"),
                                f"set preference.loss to one of {', '.join(accepted)}"))
        return
    if objective != "dpo" and len(names) > 1:
        problems.append(Problem(f"train.objective {objective} takes one loss type, got {len(names)}",
                                where("preference.loss"), f"set preference.loss to one of {', '.join(accepted)}"))
    if objective == "dpo" and pref.loss_weights is not None:
        try:
            check_loss_types(names, pref.loss_weights, accepted)
        except ValueError as err:
            problems.append(Problem(str(err), where("preference.loss_weights"),
                                    "give one weight per preference.loss entry, or remove preference.loss_weights"))
    if objective == "dpo":
        try:
            check_label_smoothing(names, pref.label_smoothing)
        except ValueError as err:
            problems.append(Problem(str(err), where("preference.label_smoothing"), "change it as the message says"))


def _resolve_reference(config: RunConfig, merged: Merged, problems: list[Problem], notes: dict[str, str]) -> None:
    """preference.reference: "auto" decided; a mode the objective or the model cannot have is a problem."""
    objective, pref, where = config.train.objective, config.preference, merged.where
    lora = config.model.lora is not None
    if pref.reference == "auto":
        pref.reference = auto_reference(objective, lora)
        why = ("the objective reads no reference" if pref.reference == "none" else
               "the model with its LoRA adapters switched off" if lora else "a frozen copy of the starting model")
        notes["preference.reference"] = f"auto: {pref.reference} ({why})"
        return
    if objective in OBJECTIVES_WITHOUT_REFERENCE:
        return  # a mode set for simpo, orpo or reward is ignored: READ_BY's warning says so
    if pref.reference == "none":
        problems.append(Problem(f"train.objective {objective} compares the policy with a reference model, and "
                                f"reference none gives it none", where("preference.reference"),
                                "set preference.reference: auto (or model, adapters_off, precomputed), or use "
                                "train.objective simpo or orpo, which need no reference"))
    if pref.reference == "adapters_off" and not lora:
        problems.append(Problem("reference adapters_off reads the base model under the LoRA adapters, but "
                                "model.lora is not set", where("preference.reference"),
                                "set model.lora (e.g. --set model.lora={r: 16}), or preference.reference: model"))
