"""A real, small Hugging Face tokenizer built here, without downloads: byte-level BPE trained on a
few sentences, with ChatML special tokens and a chat template, saved with save_pretrained."""

from __future__ import annotations

from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
# ChatML as many models write it; no {% generation %} marks, so assistant turns are found by prefixes.
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# The same rendering with the assistant's part marked, for transformers' own assistant mask.
CHATML_MARKED = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
                 "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>' }}"
                 "{% endgeneration %}{{ '\\n' }}{% else %}{{ m['content'] + '<|im_end|>\\n' }}{% endif %}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "Explain photosynthesis in one sentence. Plants turn light, water and air into sugar.",
    "Name three primary colours. Red, yellow and blue.",
    "user assistant system",
]


def build_tokenizer(directory: Path, chat_template: str | None = CHATML, bos: bool = False,
                    texts: tuple[str, ...] = (), vocab_size: int = 320) -> Path:
    """Train the tokenizer (on TRAINING_TEXT and `texts`), save it under `directory`, return the directory.
    `bos`: the tokenizer puts <|endoftext|> before every text it encodes with special tokens (as
    Llama's puts <s>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(TRAINING_TEXT * 4 + list(texts), trainer)
    if bos:
        bpe.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A",
                                                           special_tokens=[("<|endoftext|>", 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<pad>",
                                        bos_token="<|endoftext|>" if bos else None)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(directory)
    return directory
