"""Tiny Hugging Face models for tests, built from small configs in code and saved with save_pretrained
(no downloads). Vocabulary 256, so dstrain's byte-level data feeds them directly."""

from __future__ import annotations

from pathlib import Path

import torch


def save_tiny_llama(directory: Path, seed: int = 0, vocab_size: int = 256, intermediate_size: int = 64) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=intermediate_size, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def save_tiny_qwen2(directory: Path, seed: int = 0, tied: bool = True, vocab_size: int = 256) -> Path:
    """Qwen2: biases on the query, key and value projections, 2 key-value heads, and (as Qwen2's small
    models) the output head tied to the token embedding unless `tied` is False."""
    from transformers import AutoModelForCausalLM, Qwen2Config
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def save_tiny_gpt2(directory: Path, seed: int = 0) -> Path:
    """GPT-2 ties its output head to the token embedding and uses Conv1D (transposed) layers."""
    from transformers import AutoModelForCausalLM, GPT2Config
    torch.manual_seed(seed)
    # No dropout: dstrain trains in training mode, transformers_loss computes in eval mode, and the
    # tests compare the two on the same weights and batch.
    config = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=256, n_positions=64, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def transformers_loss(model_dir: Path, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    """The loss transformers itself computes for a dstrain (inputs, targets) window batch: the model is
    given the whole window (inputs plus the last target) with labels=window, and shifts them itself."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    window = torch.cat([inputs, targets[:, -1:]], dim=1).long()
    with torch.no_grad():
        return model(input_ids=window, labels=window).loss.item()
