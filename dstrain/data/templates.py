"""Named chat templates, for tokenizers that have none: `data.chat_template: chatml` (or a file).

Each is a Jinja template in the form transformers' apply_chat_template renders, written for dstrain
after the published formats of each family, with the assistant's text and its end-of-turn marker
inside {% generation %} blocks, so the tokens learned are exactly the marked ones
(dstrain/data/chat.py). The markers (<|im_start|>, <|eot_id|>, ...) should be tokens of the
tokenizer: `check_markers` warns where they are not, since they are then spelled out in pieces.

- chatml: <|im_start|>role\\ncontent<|im_end|>\\n per message (OpenAI's ChatML; Qwen, many fine-tunes).
- qwen2: ChatML with Qwen2's default system message when the conversation has none.
- llama3: <|start_header_id|>role<|end_header_id|>\\n\\n content<|eot_id|>, after the BOS token.
- mistral: [INST] user [/INST]answer</s> (Mistral 7B Instruct v0.1-v0.3); a system message is put
  before the first user message, as Mistral's own template does.
- gemma: <start_of_turn>user|model\\n content<end_of_turn>\\n after the BOS token; Gemma has no system
  role, so a system message opens the first user turn.
"""

from __future__ import annotations

from pathlib import Path

from dstrain.errors import UserError

_BOS = "{% if bos_token %}{{ bos_token }}{% endif %}"

CHATML = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

QWEN2 = (
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}" + CHATML)

LLAMA3 = (
    _BOS + "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")

MISTRAL = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] + '\\n\\n' %}"
    "{% set turns = messages[1:] %}{% else %}{% set system = '' %}{% set turns = messages %}{% endif %}"
    + _BOS + "{% for message in turns %}"
    "{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + (system if loop.first else '') + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + (eos_token or '') }}{% endgeneration %}"
    "{% else %}{{ raise_exception('the mistral template knows the roles system (first), user and assistant') }}"
    "{% endif %}{% endfor %}")

GEMMA = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] + '\\n\\n' %}"
    "{% set turns = messages[1:] %}{% else %}{% set system = '' %}{% set turns = messages %}{% endif %}"
    + _BOS + "{% for message in turns %}"
    "{% if message['role'] == 'assistant' %}{{ '<start_of_turn>model\\n' }}"
    "{% generation %}{{ message['content'] | trim + '<end_of_turn>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<start_of_turn>' + message['role'] + '\\n' + (system if loop.first else '') + "
    "message['content'] | trim + '<end_of_turn>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")

TEMPLATES = {"chatml": CHATML, "qwen2": QWEN2, "llama3": LLAMA3, "mistral": MISTRAL, "gemma": GEMMA}
# The special strings each template writes: they should be single tokens of the tokenizer.
MARKERS = {"chatml": ("<|im_start|>", "<|im_end|>"), "qwen2": ("<|im_start|>", "<|im_end|>"),
           "llama3": ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
           "mistral": ("[INST]", "[/INST]"), "gemma": ("<start_of_turn>", "<end_of_turn>")}


def uses_template(data) -> bool:
    """Whether data.format renders conversations (and so reads data.chat_template). "preference" renders
    its message rows (and Alpaca rows, once a template is set); text rows need none, so the tokenizer's own
    template is looked for only when a message row comes."""
    return data.format in ("chat", "sharegpt") or (data.format in ("alpaca", "preference")
                                                   and data.chat_template is not None)


def named_or_file(value: str) -> str:
    """The template `data.chat_template` names: a name of TEMPLATES, else a Jinja file's text."""
    if value in TEMPLATES:
        return TEMPLATES[value]
    path = Path(value)
    if not path.is_file():
        raise UserError.single(f"{value!r} is neither a template name nor a file", "data.chat_template",
                               f"use one of {', '.join(TEMPLATES)}, or the path of a Jinja template file")
    return path.read_text(encoding="utf-8")


def check_markers(name: str | None, tokenizer) -> list[str]:
    """Warnings for the markers of a named template that the tokenizer does not hold as one token."""
    if name not in MARKERS or tokenizer is None:
        return []
    vocabulary = tokenizer.get_vocab()
    missing = [marker for marker in MARKERS[name] if marker not in vocabulary]
    if not missing:
        return []
    return [f"data.chat_template {name}: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not a token of "
            f"the tokenizer and will be spelled out in several tokens; a tokenizer made for the {name} format "
            "has them (or choose the template of your model's family)"]
