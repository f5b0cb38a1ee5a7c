"""Create a small Llama-style model with random weights, and a tokenizer for it, in a local folder, so the
fine-tuning example runs offline. A real fine-tune names a downloaded model folder (or a hub id) instead.

    python examples/finetune_llama/make_tiny_llama.py models/tiny-llama [--layers 4 --width 256]

The tokenizer is a byte-level BPE trained on this example's instructions.jsonl (it needs only the
`tokenizers` package that transformers brings); the model's vocabulary is the tokenizer's size.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).parent
SPECIALS = ["<s>", "</s>", "<pad>"]


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output", type=Path)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=1024, help="BPE vocabulary to train (at most)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    rows = [json.loads(line) for line in (HERE / "instructions.jsonl").read_text().splitlines() if line.strip()]
    tokenizer = train_tokenizer([f"{r['prompt']}\n{r['response']}" for r in rows], args.vocab)
    torch.manual_seed(args.seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=args.width, intermediate_size=args.width * 8 // 3,
                         num_hidden_layers=args.layers, num_attention_heads=max(1, args.width // 64),
                         num_key_value_heads=max(1, args.width // 128), max_position_embeddings=512,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(args.output)
    tokenizer.save_pretrained(args.output)
    print(f"saved a {sum(p.numel() for p in model.parameters()):,}-parameter Llama and its "
          f"{len(tokenizer)}-token tokenizer to {args.output}")


if __name__ == "__main__":
    main()
