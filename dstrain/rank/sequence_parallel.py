"""Sequence parallelism inside a rank (train.sequence_parallel > 1): DeepSpeed's Ulysses attention for a
Hugging Face model (deepspeed.runtime.sequence_parallel.ulysses_sp, ALST), through its public entry point.

`register_with_transformers` makes DeepSpeed's sequence-parallel groups (consecutive ranks, the
`parallel_state_sp` mpu that `deepspeed.initialize` then takes, so ZeRO shards and reduces over all
ranks and averages the gradients over the data-parallel groups only) and puts its attention in place
of the model's own attention function in transformers' registry: each rank projects the queries,
keys and values of its share of the tokens, an all-to-all trades tokens for heads, the core attention
runs over the whole sequence for heads / N heads, and a second all-to-all trades back. The batches
(dstrain.data.sequence) and the loss (dstrain.models.hf.CausalLM) are dstrain's.
"""

from __future__ import annotations


def gradient_scale(ds_config: dict, sequence_parallel: int) -> float:
    """The factor on each rank's share of the gradient that makes DeepSpeed's reduction give the gradient of
    the whole samples, averaged over the data-parallel groups. DeepSpeed sums the gradients over all ranks
    (data- and sequence-parallel) and divides by the data-parallel size in ZeRO stages 0-2 and in stage 3
    without reduce_scatter, but by the whole world size in stage 3's reduce-scatter path (its default:
    reduce_scatter_coalesced averages; DeepSpeed 0.19.8), where the shares must count sequence_parallel
    times. Checked by tests/test_sequence_parallel.py: the gradient norm equals the run's without it."""
    zero = ds_config.get("zero_optimization") or {}
    if zero.get("stage", 0) == 3 and zero.get("reduce_scatter", True):
        return float(sequence_parallel)
    return 1.0


def enable(model, config, ds_config: dict) -> object:
    """Turn sequence parallelism on for `model` (a dstrain.models.hf.CausalLM, built, not yet wrapped by
    DeepSpeed): returns the mpu for deepspeed.initialize. Every rank calls it, in the same order."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    hf_model = model.model
    attention = getattr(hf_model.config, "_attn_implementation", None) or "sdpa"
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=hf_model, core_attn_implementation=attention,
        sequence_parallel_size=config.train.sequence_parallel, micro_batch_size=config.train.micro_batch_size,
        seq_length_is_variable=True)
    model.sequence_group = mpu.get_sequence_parallel_group()
    model.sequence_grad_scale = gradient_scale(ds_config, config.train.sequence_parallel)
    return mpu
