"""The rank's side of preference training (train.objective dpo, simpo, orpo, kto; the loss itself is
dstrain.models.preference): the frozen reference copy, the weight of each micro batch's loss in its step,
and the metrics (TRL's names) averaged over micro batches and ranks.

Averaging. Each micro batch's loss is the mean over its pairs (KTO: examples), as TRL computes it. Packed
micro batches hold different numbers of pairs, so a plain mean over micro batches (what DeepSpeed's
gradient accumulation and TRL do) would weight a pair by 1 / (pairs in its micro batch). Here the loss of
micro batch b is multiplied by n_b * accum * world / N (n_b its pairs, N the step's pairs over all ranks,
known on every rank from the sampler without communication): DeepSpeed's mean over accum * world micro
batches then gives the step's mean over its pairs. For losses that are per-pair means (every DPO type but
"sft", SimPO, ORPO's odds-ratio term, KTO) that is exactly the mean over the step's pairs; the token-mean
NLL terms (sft, cpo_alpha, ORPO's chosen NLL) become the pair-weighted mean of the micro batches' values.
With padded rows every micro batch has the same number of pairs: the weight is 1, as in TRL.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from dstrain.models.preference import METRICS, units_in


def micro_batch_weight(batch: dict, step_units: int, micro_batches: int) -> float:
    """What micro batch `batch`'s mean loss is multiplied by (see the module docstring): its pairs times the
    micro batches of the step (accum * world) over the step's pairs."""
    return units_in(batch) * micro_batches / max(step_units, 1)


class PreferenceMetrics:
    """The objective's metrics (rewards/*, logps/*, and its own) summed as (value * weight, weight) over
    micro batches; `reduce` adds the ranks' sums (one all-reduce) and gives each weighted mean. KTO's
    rewards/margins is the difference of the two sides' means, as TRL logs it."""

    def __init__(self, objective: str, device):
        self.objective = objective
        self.names = METRICS[objective]
        self.sums = torch.zeros(len(self.names), 2, dtype=torch.float64, device=device)

    def add(self, metrics: dict) -> None:
        """One micro batch's last_metrics: name -> (value tensor, weight)."""
        for i, name in enumerate(self.names):
            value, weight = metrics[name]
            if weight:
                self.sums[i, 0] += value.detach().double() * weight
                self.sums[i, 1] += weight

    def reduce(self) -> dict[str, float]:
        """Every rank calls it (a collective): the weighted means, then the sums start again."""
        dist.all_reduce(self.sums)
        out = {name: (self.sums[i, 0] / self.sums[i, 1]).item() for i, name in enumerate(self.names)
               if self.sums[i, 1].item() > 0}
        if self.objective == "kto" and "rewards/chosen" in out and "rewards/rejected" in out:
            out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        self.sums.zero_()
        return out

    def reset(self) -> None:
        self.sums.zero_()


def needs_reference_copy(config) -> bool:
    return config.train.objective != "lm" and config.preference.reference == "model"


def rng_state() -> dict:
    """The random generators' state before the policy is built: the reference copy is built from the same,
    so that weights initialised at random (the built-in GPT, LoRA's A matrices) are the policy's."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def build_reference(config, ds_config: dict, device, policy_rng: dict):
    """preference.reference "model": a frozen copy of the starting weights (the model as build_model makes it,
    from the same random state as the policy), eval mode, no gradient. ZeRO-3: built inside zero.Init and
    wrapped by a second deepspeed.initialize without optimizer, so it is partitioned like the policy and its
    parameters are gathered layer by layer; stages 0-2: a whole replica on every rank, in the run's 16-bit
    dtype where the run trains in one (as the engine casts the policy). Returns the module to call."""
    import deepspeed

    from dstrain.models import build_model
    zero3 = (ds_config.get("zero_optimization") or {}).get("stage", 0) == 3
    devices = [torch.cuda.current_device()] if "cuda" in policy_rng else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(policy_rng["cpu"])
        if "cuda" in policy_rng:
            torch.cuda.set_rng_state(policy_rng["cuda"])
        model = build_model(config, ds_config, device)
    model.requires_grad_(False)
    model.eval()
    if zero3:
        frozen = copy.deepcopy(ds_config)
        for key in ("optimizer", "scheduler"):
            frozen.pop(key, None)
        frozen["zero_optimization"].pop("offload_optimizer", None)
        from dstrain.speedups import building_engine
        with building_engine(config.speedups):  # as the policy's: the same start-up changes
            engine, *_ = deepspeed.initialize(model=model, config=frozen)
        engine.eval()
        return engine.module
    if (ds_config.get("bf16") or {}).get("enabled"):
        model.to(torch.bfloat16)
    elif (ds_config.get("fp16") or {}).get("enabled"):
        model.to(torch.float16)
    return model.to(device)


def set_up_reference(model, config, ds_config: dict, device, policy_rng: dict) -> str | None:
    """Give the model's preference objective its reference copy where preference.reference is "model";
    a line saying which reference the run compares with (None for lm)."""
    if config.train.objective == "lm":
        return None
    mode = config.preference.reference
    if mode == "model":
        model.preference.reference = build_reference(config, ds_config, device, policy_rng)
        zero3 = (ds_config.get("zero_optimization") or {}).get("stage", 0) == 3
        how = ("partitioned like the policy (ZeRO-3, a second engine without optimizer)" if zero3 else
               "a whole replica on every rank (ZeRO 0-2)")
        return f"preference: train.objective {config.train.objective}, reference: a frozen copy of the starting weights, {how}"
    if mode == "precomputed":
        return None  # dstrain.rank.precomputed attaches it and says where it came from
    if mode == "adapters_off":
        return (f"preference: train.objective {config.train.objective}, reference: the same model with its LoRA "
                "adapters switched off")
    return f"preference: train.objective {config.train.objective}, no reference model"
