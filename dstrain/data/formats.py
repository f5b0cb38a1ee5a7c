"""How rows become token ids and labels, by `data.format`.

- "text": each document's tokens (after the tokenizer's own leading special tokens, e.g. BOS) and
  an end-of-text token, all documents joined into one stream that the sampler cuts into seq_len
  windows (packing). Every token is a label.
- "prompt_response": one example per row, prompt tokens then response tokens then end-of-text,
  joined as they are (no separator: end the prompt with whatever the model should see between).
  Labels are -100 on the prompt (and its leading special tokens), the token ids on the response
  and its end-of-text.
- "chat": one example per row, rendered by the chat template; labels only on assistant turns
  (dstrain/data/chat.py finds them).

Examples are stored flat, each cut to seq_len (`truncated`); the sampler pads each to a row or
packs several to a row (data.packing, dstrain/data/sampler.py). An example left with no label to
predict after the cut is dropped (`dropped`): the model predicts labels[t + 1] from position t, so
a label at position 0 alone teaches nothing.
- "alpaca" and "sharegpt": common dataset layouts, turned into prompt/response pairs or
  conversations by dstrain/data/layouts.py.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import numpy as np

from dstrain.config.schema import DataConfig
from dstrain.errors import Problem, UserError

IGNORE = -100  # the label of a position without loss (PyTorch's and Hugging Face's ignore_index)
MAX_REPORTED = 3  # bad rows reported one by one; the rest are counted


@dataclass
class Encoded:
    """Tokenized rows. "text": `tokens`, one packed stream. Other formats: example i is
    ids[offsets[i]:offsets[i + 1]] with its labels at the same places; "preference" also groups the
    examples of a row (a pair's two) and keeps them together (dstrain/data/preference.py)."""

    format: str
    pad_id: int
    tokens: np.ndarray | None = None
    ids: np.ndarray | None = None
    labels: np.ndarray | None = None
    offsets: np.ndarray | None = None
    groups: np.ndarray | None = None  # format "preference": group g is examples groups[g]:groups[g + 1]
    desirable: np.ndarray | None = None  # format "preference": per example, chosen (or KTO-desirable) 1
    margins: np.ndarray | None = None  # format "preference": per group, nan where the row has none
    stats: dict = field(default_factory=dict)  # rows, truncated, dropped, longest

    def max_id(self) -> int:
        array = self.tokens if self.tokens is not None else self.ids
        return int(array.max()) if len(array) else 0


class Encoder:
    """A tokenizer seen through what the formats need: plain encoding, the leading special tokens
    the tokenizer adds itself, end-of-text and padding ids. "byte" is one token per UTF-8 byte,
    with byte 0 (NUL, which text does not contain) as end-of-text."""

    def __init__(self, name: str, hf=None):
        self.name, self.hf = name, hf
        if hf is None:
            self.prefix, self.eos_id, self.pad_id = [], 0, 0
            return
        plain = hf("x", add_special_tokens=False)["input_ids"]
        full = hf("x", add_special_tokens=True)["input_ids"]
        start = next((i for i in range(len(full)) if full[i:i + len(plain)] == plain), 0)
        self.prefix = list(full[:start])  # e.g. [BOS] for Llama-style tokenizers, [] for GPT-2's
        self.eos_id = hf.eos_token_id
        self.pad_id = next(t for t in (hf.pad_token_id, hf.eos_token_id, 0) if t is not None)

    def encode(self, texts: list[str]) -> list[list[int]]:
        if self.hf is None:
            return [list(text.encode("utf-8")) for text in texts]
        return list(self.hf(texts, add_special_tokens=False)["input_ids"]) if texts else []

    def require_eos(self, data_format: str) -> int:
        if self.eos_id is None:
            raise UserError.single(f"tokenizer {self.name!r} has no end-of-text token, which format "
                                   f"{data_format!r} puts after each document or response", "data.tokenizer",
                                   "use a tokenizer with an eos_token (set eos_token in its tokenizer_config.json)")
        return self.eos_id

    def fingerprint(self) -> str:
        """Everything about the tokenizer that decides the token ids, hashed, for the cache key."""
        if self.hf is None:
            return "byte"
        backend = getattr(self.hf, "backend_tokenizer", None)
        vocabulary = backend.to_str() if backend is not None else json.dumps(sorted(self.hf.get_vocab().items()))
        facts = [type(self.hf).__name__, vocabulary, self.hf.chat_template or "", self.prefix, self.eos_id,
                 self.pad_id, sorted(map(str, self.hf.all_special_tokens))]
        return hashlib.sha256(json.dumps(facts, default=str).encode()).hexdigest()


def load_encoder(data: DataConfig) -> Encoder:
    """The Encoder of data.tokenizer (already resolved: never None here)."""
    if data.tokenizer == "byte":
        return Encoder("byte")
    from dstrain.data.sources import load_tokenizer
    return Encoder(data.tokenizer, load_tokenizer(data.tokenizer))


def field_values(rows: list[tuple[str, dict]], name: str, key: str, kind: type, what: str) -> list:
    """Field `name` of every row, of type `kind`; rows without it (or of another type) are reported
    with their file and line, the config key that names the field, and the fix."""
    values, problems, unreported = [], [], 0
    for where, row in rows:
        value = row.get(name)
        if isinstance(value, kind):
            values.append(value)
        elif len(problems) == MAX_REPORTED:
            unreported += 1
        elif name not in row:
            problems.append(Problem(f"the row has no field {name!r} (its fields: {', '.join(map(str, row)) or 'none'})",
                                    f"{where} ({key})",
                                    f"set {key} to the field that holds the {what}, or add {name!r} to every row"))
        else:
            problems.append(Problem(f"field {name!r} is {type(value).__name__}, not {kind.__name__}",
                                    f"{where} ({key})", f"make {name!r} hold the {what} in every row"))
    if unreported:
        problems.append(Problem(f"and {unreported} more rows like these", key))
    if problems:
        raise UserError(problems)
    return values


def encode_text(rows: list[tuple[str, dict]], data: DataConfig, encoder: Encoder) -> Encoded:
    """Format "text": [prefix] document [eos] for each row, one packed stream."""
    eos = encoder.require_eos("text")
    documents = field_values(rows, data.fields.text, "data.fields.text", str, "document text")
    ids: list[int] = []
    for tokens in encoder.encode(documents):
        ids += encoder.prefix + tokens + [eos]
    dtype = np.uint32 if max(ids, default=0) >= 2**16 else np.uint16
    return Encoded("text", encoder.pad_id, tokens=np.asarray(ids, dtype=dtype), stats={"rows": len(rows)})


def encode_prompt_response(rows: list[tuple[str, dict]], data: DataConfig, encoder: Encoder) -> Encoded:
    """Format "prompt_response": [prefix] prompt response [eos]; labels on response and eos only."""
    prompts = field_values(rows, data.fields.prompt, "data.fields.prompt", str, "prompt")
    responses = field_values(rows, data.fields.response, "data.fields.response", str, "response")
    return encode_pairs("prompt_response", prompts, responses, data, encoder)


def encode_pairs(data_format: str, prompts: list[str], responses: list[str], data: DataConfig,
                 encoder: Encoder) -> Encoded:
    """[prefix] prompt response [eos] for each pair; labels on response and eos only."""
    eos = encoder.require_eos(data_format)
    examples = []
    for prompt, response in zip(encoder.encode(prompts), encoder.encode(responses)):
        context = encoder.prefix + prompt
        examples.append((context + response + [eos], [IGNORE] * len(context) + response + [eos]))
    return store_examples(data_format, examples, data.seq_len, encoder.pad_id)


def store_examples(data_format: str, examples: list[tuple[list[int], list[int]]], seq_len: int,
                  pad_id: int) -> Encoded:
    """Examples cut to seq_len, those left with nothing to predict dropped, stored flat with offsets."""
    ids, labels, offsets = [], [], [0]
    truncated = dropped = longest = 0
    for example_ids, example_labels in examples:
        longest = max(longest, len(example_ids))
        if len(example_ids) > seq_len:
            truncated += 1
            example_ids, example_labels = example_ids[:seq_len], example_labels[:seq_len]
        if all(label == IGNORE for label in example_labels[1:]):
            dropped += 1
            continue
        ids += example_ids
        labels += example_labels
        offsets.append(len(ids))
    return Encoded(data_format, pad_id, ids=np.asarray(ids, dtype=np.int32), labels=np.asarray(labels, dtype=np.int32),
                   offsets=np.asarray(offsets, dtype=np.int64),
                   stats={"rows": len(examples), "truncated": truncated, "dropped": dropped, "longest": longest})
