"""One DPO step on one rank with a real deepspeed.initialize (tests/test_preference_training.py), for each of
params["cases"] in turn, in one start-up: a tiny hf Llama, preference.reference `adapters_off` (LoRA, ZeRO-2)
or `model` (a frozen copy, ZeRO-3), each its own engine and folder. Returns, by reference mode, the loss of
step 1 (policy == reference), and the loss the engine computes on a second batch after the update beside the
DPO loss computed by hand from the same weights: the policy's full logits (its current weights, gathered)
and a fresh copy of the starting model as the reference."""

from __future__ import annotations

import sys
from pathlib import Path

from scripts.rank_setup import parameters, result, start_rank


def main() -> None:
    params = parameters()
    start_rank(params)
    result({case["reference"]: one_step(case) for case in params["cases"]})


def one_step(params: dict) -> dict:
    """One case's engine, step and losses."""
    import deepspeed
    import torch

    from dstrain.config.resolve import resolve
    from dstrain.data import build_samplers
    from dstrain.models import build_model, hf
    from dstrain.models import preference_loss as pl
    from dstrain.rank.preference import rng_state, set_up_reference
    from dstrain.rank.runtime import initialize_engine, seed_everything
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from hf_models import save_tiny_llama
    from preference_data import write_zen_pairs

    work = Path(params["dir"])
    model_dir = save_tiny_llama(work / "llama")
    sets = ["train.objective=dpo", "data.format=preference", "data.source=jsonl",
            f"data.paths=[{write_zen_pairs(work / 'pairs.jsonl')}]", "data.tokenizer=byte",
            f"data.cache_dir={work / 'cache'}", "data.seq_len=96", "data.packing=true", f"model.name=hf:{model_dir}",
            "train.micro_batch_size=2", "train.lr=0.05", "train.warmup_steps=0", "train.schedule=constant",
            "train.activation_checkpointing=false", f"preference.reference={params['reference']}",
            "preference.beta=0.5", *params.get("sets", [])]
    resolved = resolve(params["preset"], None, sets, world_size=1, accelerator="cpu", env={})
    config, ds_config = resolved.config, resolved.ds_config
    seed_everything(config.train.seed)
    train_sampler, _ = build_samplers(config)
    policy_rng = rng_state()
    model = build_model(config, ds_config, torch.device("cpu"))
    engine = initialize_engine(model, ds_config)
    set_up_reference(model, config, ds_config, torch.device("cpu"), policy_rng)
    engine.train()

    first = engine(train_sampler.batch(0, 2))
    engine.backward(first)
    engine.step()
    batch = train_sampler.batch(2, 2)
    with torch.no_grad():
        engine_loss = engine(batch).item()

    def summed(module, state=None):
        """Per-completion summed log-probs of `batch` from the whole logits of `module`."""
        targets, segments = model.preference.targets_of(batch)
        with torch.no_grad():
            logits = module(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        logps = logits.float().log_softmax(-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        logps = torch.where(targets != -100, logps, 0.0)
        return pl.segment_logps(logps, segments, len(batch["desirable"]))[0]

    from transformers import AutoModelForCausalLM
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if params["reference"] == "adapters_off":  # ZeRO-2: the policy's weights are whole; its peft model's logits
        policy = model.model.eval()
    else:  # ZeRO-3: gather the trained weights into a fresh copy
        policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            trained = {hf.own_name(name): p.detach().clone() for name, p in model.named_parameters()}
        policy.load_state_dict(trained)
    mine, theirs = summed(policy), summed(reference)
    pairs = len(batch["margin"])
    by_hand = pl.dpo_loss(mine[:pairs], mine[pairs:], theirs[:pairs], theirs[pairs:], beta=0.5).loss.item()
    return {"first": first.item(), "engine": engine_loss, "by_hand": by_hand,
            "moved": abs(float((mine - theirs).abs().max()))}


if __name__ == "__main__":
    main()
