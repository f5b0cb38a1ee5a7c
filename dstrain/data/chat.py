"""Format "chat": a `messages` list rendered by the chat template (data.chat_template, a name of
dstrain/data/templates.py or a file, else the tokenizer's own), the loss on assistant turns only.
Formats "sharegpt" and "alpaca" (with a template) come here as messages too (dstrain/data/layouts.py).

Which tokens belong to assistant turns is found in one of two ways:
- The template marks them itself with `{% generation %}` blocks: transformers' own assistant mask
  (apply_chat_template's return_assistant_tokens_mask) is used.
- Otherwise, by rendering prefixes of the conversation: assistant turn i starts where
  render(messages[:i], add_generation_prompt=True) ends (after the template's assistant header) and
  ends where render(messages[:i + 1]) ends (its end-of-turn marker included, so the model learns to
  stop). The whole conversation is tokenized once, and a token is an assistant token when its first
  character (the tokenizer's offset mapping) lies in such a span. A template that renders earlier
  turns differently once later turns follow (it is not prefix-stable) is reported, not guessed at.
"""

from __future__ import annotations

import re
from pathlib import Path

from dstrain.config.schema import DataConfig
from dstrain.data.formats import IGNORE, Encoded, Encoder, field_values, store_examples
from dstrain.errors import UserError

ASSISTANT = "assistant"
GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")


def chat_template(data: DataConfig, encoder: Encoder, data_format: str = "chat") -> str:
    """data.chat_template (a name of dstrain.data.templates, or a Jinja file), else the tokenizer's own
    template; an error when there is none."""
    from dstrain.data.templates import TEMPLATES, named_or_file
    if encoder.hf is None:
        raise UserError.single(f"format {data_format!r} needs a Hugging Face tokenizer to render and tokenize "
                               "messages, and data.tokenizer is byte", "data.tokenizer",
                               "set data.tokenizer to a tokenizer name or directory (an hf: model's is the default)")
    if data.chat_template is not None:
        return named_or_file(data.chat_template)
    template = encoder.hf.chat_template
    if isinstance(template, dict):  # several named templates: the one apply_chat_template uses by default
        template = template.get("default")
    if not template:
        raise UserError.single(f"tokenizer {encoder.name!r} has no chat template, which format {data_format!r} "
                               "renders messages with", "data.tokenizer / data.chat_template",
                               f"set data.chat_template to one of {', '.join(TEMPLATES)} (the format your model "
                               "was or will be trained in), or to a Jinja template file")
    return template


def check_messages(where: str, messages: list, key: str) -> None:
    """Every message a {role, content} object, and at least one assistant turn to learn from."""
    for number, message in enumerate(messages, start=1):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
            raise UserError.single(f"message {number} is not an object with 'role' and 'content'", f"{where} ({key})",
                                   'write each message as {"role": "user", "content": "..."}')
    if not any(message["role"] == ASSISTANT for message in messages):
        roles = ", ".join(sorted({m["role"] for m in messages})) or "no messages"
        raise UserError.single(f"the conversation has no assistant turn (roles: {roles}): nothing to learn from",
                               f"{where} ({key})", "add the assistant's reply, or remove the row")


def encode_chat(rows: list[tuple[str, dict]], data: DataConfig, encoder: Encoder) -> Encoded:
    key = "data.fields.messages"
    conversations = field_values(rows, data.fields.messages, key, list, "list of messages")
    return encode_conversations("chat", [where for where, _ in rows], conversations, data, encoder, key)


def encode_conversations(data_format: str, wheres: list[str], conversations: list[list], data: DataConfig,
                         encoder: Encoder, key: str) -> Encoded:
    """Conversations ({role, content} messages; `wheres`: the row each came from, `key`: the config key
    that names its field, for messages) rendered and labelled as format "chat" does."""
    examples = conversation_examples(data_format, wheres, conversations, data, encoder, key)
    return store_examples(data_format, examples, data.seq_len, encoder.pad_id)


def conversation_examples(data_format: str, wheres: list[str], conversations: list[list], data: DataConfig,
                          encoder: Encoder, key: str,
                          score_from: list[int] | None = None) -> list[tuple[list[int], list[int]]]:
    """(ids, labels) of each conversation, labels on its assistant turns. `score_from[i]`: conversation i's
    assistant turns before that message index are context, not labels (format "preference": the prompt's
    turns, which the chosen and rejected completions share)."""
    template = chat_template(data, encoder, data_format)
    marked = GENERATION_BLOCK.search(template) is not None
    examples = []
    for number, (where, messages) in enumerate(zip(wheres, conversations)):
        check_messages(where, messages, key)
        first = score_from[number] if score_from else 0
        render = _renderer(encoder.hf, template, where, key)
        examples.append(_by_generation_mask(encoder.hf, messages, template, where, key, first) if marked
                        else _by_prefixes(encoder.hf, messages, render, where, first))
    return examples


def _renderer(tokenizer, template: str, where: str, key: str):
    def render(messages: list, add_generation_prompt: bool) -> str:
        try:
            return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt)
        except Exception as err:  # noqa: BLE001 - the template rejects this conversation
            raise UserError.single(f"the chat template cannot render this conversation: {type(err).__name__}: {err}",
                                   f"{where} ({key})",
                                   "fix the row (e.g. roles in the order the template expects)") from None
    return render


def _by_generation_mask(tokenizer, messages: list, template: str, where: str, key: str,
                        first: int = 0) -> tuple[list[int], list[int]]:
    try:
        out = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        context = (tokenizer.apply_chat_template(messages[:first], chat_template=template, tokenize=True,
                                                 return_dict=True, add_generation_prompt=True)["input_ids"]
                   if first else [])
    except Exception as err:  # noqa: BLE001 - the template rejects this conversation
        raise UserError.single(f"the chat template cannot render this conversation: {type(err).__name__}: {err}",
                               f"{where} ({key})", "fix the row (e.g. roles in the order the template expects)") from None
    ids = list(out["input_ids"])
    if list(context) != ids[:len(context)]:  # the prompt's tokens must open the whole conversation's
        raise UserError.single(f"the chat template renders the prompt's {first} turns differently once the "
                               "completion follows, so the completion's tokens cannot be told apart",
                               f"{where} (data.chat_template)", "use a template that renders earlier turns alike")
    return ids, [token if mask and at >= len(context) else IGNORE
                 for at, (token, mask) in enumerate(zip(ids, out["assistant_masks"]))]


def _by_prefixes(tokenizer, messages: list, render, where: str, first: int = 0) -> tuple[list[int], list[int]]:
    full = render(messages, False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != ASSISTANT or i < first:
            continue
        before, through = render(messages[:i], True), render(messages[:i + 1], False)
        if not (through.startswith(before) and full.startswith(through)):
            raise UserError.single(f"the chat template renders turn {i + 1} differently once later turns follow, "
                                   "so the assistant's tokens cannot be found by rendering prefixes",
                                   f"{where} (data.chat_template)",
                                   "set data.chat_template to a template that marks assistant turns with "
                                   "{% generation %} ... {% endgeneration %}")
        spans.append((len(before), len(through)))
    try:
        encoding = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError:
        raise UserError.single(f"tokenizer {tokenizer.name_or_path!r} gives no character offsets (not a fast "
                               "tokenizer)", "data.tokenizer",
                               "use a fast tokenizer (a tokenizer.json), or a template with {% generation %} blocks")
    ids = list(encoding["input_ids"])
    labels = [token if any(lo <= start < hi for lo, hi in spans) else IGNORE
              for token, (start, _end) in zip(ids, encoding["offset_mapping"])]
    return ids, labels
