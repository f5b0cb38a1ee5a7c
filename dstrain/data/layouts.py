"""Common dataset layouts, read into dstrain's own formats.

- "alpaca": rows of `instruction`, optional `input` and `output` (Stanford Alpaca and the many sets
  in its layout; field names through data.fields). Without data.chat_template, the prompt is the
  fixed Alpaca prompt below and the output follows it, as format "prompt_response" (loss on the
  output and end-of-text). With data.chat_template set, the row is a user turn (the instruction,
  then the input after a blank line) and an assistant turn (the output), rendered as format "chat".
  The tokenizer's own template is not used unasked: the same rows give the same tokens whatever
  tokenizer happens to carry a template.
- "sharegpt": rows of `conversations`, a list of {"from": ..., "value": ...} turns (ShareGPT, Vicuna,
  OpenHermes, ...; every key configurable), speakers mapped to chat roles by data.fields.roles
  (human -> user, gpt -> assistant, system -> system, ...), then rendered as format "chat".
"""

from __future__ import annotations

from dstrain.config.schema import DataConfig
from dstrain.data.formats import MAX_REPORTED, Encoded, Encoder, encode_pairs, field_values
from dstrain.errors import Problem, UserError

# Stanford Alpaca's prompts (github.com/tatsu-lab/stanford_alpaca, train.py), with and without an input.
ALPACA_PROMPT = ("Below is an instruction that describes a task, paired with an input that provides further "
                 "context. Write a response that appropriately completes the request.\n\n"
                 "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA_PROMPT_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately "
                          "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")


def alpaca_inputs(rows: list[tuple[str, dict]], data: DataConfig) -> list[str]:
    """Each row's input: "" where the row has none (absent or null), else the string."""
    f = data.fields
    present = [(where, row) for where, row in rows if row.get(f.input) is not None]
    field_values(present, f.input, "data.fields.input", str, "input (context) text")  # reports wrong types
    return [row.get(f.input) or "" for _, row in rows]


def encode_alpaca(rows: list[tuple[str, dict]], data: DataConfig, encoder: Encoder) -> Encoded:
    f = data.fields
    instructions = field_values(rows, f.instruction, "data.fields.instruction", str, "instruction")
    outputs = field_values(rows, f.output, "data.fields.output", str, "output (the answer)")
    inputs = alpaca_inputs(rows, data)
    if data.chat_template is None:
        prompts = [(ALPACA_PROMPT if given else ALPACA_PROMPT_NO_INPUT).format(instruction=instruction, input=given)
                   for instruction, given in zip(instructions, inputs)]
        return encode_pairs("alpaca", prompts, outputs, data, encoder)
    from dstrain.data.chat import encode_conversations
    conversations = [[{"role": "user", "content": instruction + (f"\n\n{given}" if given else "")},
                      {"role": "assistant", "content": output}]
                     for instruction, given, output in zip(instructions, inputs, outputs)]
    return encode_conversations("alpaca", [where for where, _ in rows], conversations, data, encoder,
                                "data.fields.instruction")


def sharegpt_messages(rows: list[tuple[str, dict]], data: DataConfig) -> list[list[dict]]:
    """Each row's turns as {role, content} messages; every problem (a turn that is not an object, a
    speaker data.fields.roles does not map) reported with its row."""
    f = data.fields
    key = "data.fields.conversations"
    conversations = field_values(rows, f.conversations, key, list, f"list of {{{f.role!r}, {f.content!r}}} turns")
    result, problems = [], []
    for (where, _), turns in zip(rows, conversations):
        messages = []
        for number, turn in enumerate(turns, start=1):
            if not isinstance(turn, dict) or not isinstance(turn.get(f.content), str) or f.role not in turn:
                problems.append(Problem(f"turn {number} is not an object with {f.role!r} and {f.content!r} (text)",
                                        f"{where} ({key})", "set data.fields.role and data.fields.content to the "
                                        "keys each turn uses, e.g. from/value or role/content"))
                break
            if turn[f.role] not in f.roles:
                problems.append(Problem(f"turn {number} is from {turn[f.role]!r}, which data.fields.roles does not "
                                        f"map (it maps: {', '.join(f.roles)})", f"{where} (data.fields.roles)",
                                        f"add {turn[f.role]!r} to data.fields.roles, e.g. "
                                        f"{{{turn[f.role]}: user}} (the whole mapping, since setting it replaces it)"))
                break
            messages.append({"role": f.roles[turn[f.role]], "content": turn[f.content]})
        result.append(messages)
        if len(problems) > MAX_REPORTED:
            problems[MAX_REPORTED:] = [Problem("and more rows like these", key)]
            break
    if problems:
        raise UserError(problems)
    return result


def encode_sharegpt(rows: list[tuple[str, dict]], data: DataConfig, encoder: Encoder) -> Encoded:
    from dstrain.data.chat import encode_conversations
    return encode_conversations("sharegpt", [where for where, _ in rows], sharegpt_messages(rows, data), data,
                                encoder, "data.fields.conversations")
