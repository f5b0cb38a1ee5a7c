"""Tiny models of the families dstrain's ZeRO-3 loader and hf export are tested on, saved as transformers'
save_pretrained writes them. The mixture-of-experts ones in the published per-expert layout
(experts.<i>.gate_proj/up_proj/down_proj; Mixtral's block_sparse_moe.experts.<i>.w1/w2/w3), which
transformers 5 fuses into 3-D parameters on load; the dense ones each with a trait of its own: Qwen2's
biases on q/k/v, Gemma's tied head, GPT-NeoX's head saved as embed_out (renamed to lm_head on load)."""

from __future__ import annotations

from pathlib import Path

SHAPE = dict(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64)


def config_of(family: str):
    import transformers
    if family == "qwen3_moe":  # 12 experts: the fused order must be 0, 1, 2, ... 11, not the files' 0, 1, 10, 11, 2
        return transformers.Qwen3MoeConfig(**SHAPE, intermediate_size=64, moe_intermediate_size=16, num_experts=12,
                                           num_experts_per_tok=2, head_dim=8)
    if family == "mixtral":
        return transformers.MixtralConfig(**SHAPE, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2)
    if family == "deepseek_v3":  # shared experts, a dense first layer, multi-head latent attention
        return transformers.DeepseekV3Config(**SHAPE, intermediate_size=64, moe_intermediate_size=16, n_routed_experts=4,
                                             num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                                             n_group=1, topk_group=1, q_lora_rank=16, kv_lora_rank=16,
                                             qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)
    dense = dict(SHAPE, intermediate_size=64)
    if family == "qwen2":
        return transformers.Qwen2Config(**dense)
    if family == "gemma":
        return transformers.GemmaConfig(**dense, head_dim=8)
    if family == "gpt_neox":
        return transformers.GPTNeoXConfig(**{k: v for k, v in dense.items() if k != "num_key_value_heads"})
    raise ValueError(family)


FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3")
DENSE_FAMILIES = ("qwen2", "gemma", "gpt_neox")


def save_family(family: str, folder: Path, **config_changes) -> Path:
    """A random tiny model of FAMILY written by save_pretrained into FOLDER (the published layout)."""
    import torch
    import transformers
    config = config_of(family)
    for key, value in config_changes.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # the router's and the experts' initial values alike would hide a swapped expert
        for param in model.parameters():
            param.normal_(0, 0.2)
    model.save_pretrained(folder)
    return Path(folder)
