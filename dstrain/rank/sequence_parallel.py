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


def enable(model, config) -> object:
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
    return mpu
