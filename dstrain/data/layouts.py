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
- "preference": the published layouts of preference pairs and KTO's unpaired rows (PREFERENCE_LAYOUTS),
  read into PreferenceRow (a prompt and its completions); dstrain/data/preference.py encodes them.
"""

from __future__ import annotations

from dataclasses import dataclass

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


# --- format "preference" ---------------------------------------------------------------------------------
# The layouts of preference rows, told apart by the fields a row has (data.fields names each; the first
# layout whose fields are all present wins): (layout, the DataFields keys it needs, what it is).
PREFERENCE_LAYOUTS = (
    ("kto", ("prompt", "completion", "label"),
     "unpaired (KTO): prompt, completion and label (true: desirable); strings or message lists"),
    ("sharegpt", ("conversations", "chosen", "rejected"),
     "LLaMA-Factory's ShareGPT pairs: conversations, then chosen and rejected {from, value} turns"),
    ("alpaca", ("instruction", "chosen", "rejected"),
     "LLaMA-Factory's Alpaca pairs: instruction, optional input, chosen and rejected strings"),
    ("explicit", ("prompt", "chosen", "rejected"),
     "prompt, chosen and rejected: strings, or message lists (TRL's explicit prompt)"),
    ("implicit", ("chosen", "rejected"),
     "chosen and rejected message lists that open with the same prompt turns (TRL's implicit prompt, "
     "UltraFeedback binarized)"),
)


@dataclass
class PreferenceRow:
    """One row of format "preference", read: the prompt and the completions that follow it, as text or as
    {role, content} messages; `desirable` per completion ([True, False] for a pair: chosen, rejected);
    `margin` the pair's optional margin column."""

    where: str
    prompt: str | list[dict]
    completions: list[str | list[dict]]
    desirable: list[bool]
    margin: float | None = None

    @property
    def is_text(self) -> bool:
        return isinstance(self.prompt, str) and all(isinstance(c, str) for c in self.completions)

    def conversations(self) -> tuple[list[list[dict]], int]:
        """The prompt followed by each completion, as messages, and how many messages the prompt has."""
        prompt = [{"role": "user", "content": self.prompt}] if isinstance(self.prompt, str) else self.prompt
        as_turns = [[{"role": "assistant", "content": c}] if isinstance(c, str) else c for c in self.completions]
        return [prompt + turns for turns in as_turns], len(prompt)


def preference_layout(row: dict, data: DataConfig) -> str | None:
    """The layout of PREFERENCE_LAYOUTS a row is in, by the fields it has; None for none."""
    for name, needs, _ in PREFERENCE_LAYOUTS:
        if all(getattr(data.fields, need) in row for need in needs):
            return name
    return None


def _messages(value, what: str) -> list[dict] | str:
    """`value` as a list of {role, content} messages, or the reason it is not one."""
    if not isinstance(value, list) or not value:
        return f"{what} is {type(value).__name__ if value != [] else 'an empty list'}, not a list of messages"
    for number, message in enumerate(value, start=1):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            return f"{what}: message {number} is not an object with 'role' and 'content' (text)"
    return value


def _text_or_messages(value, what: str) -> str | list[dict]:
    if isinstance(value, str):
        return value
    result = _messages(value, what)
    if isinstance(result, str):
        raise ValueError(result.replace("not a list of messages", "neither a string nor a list of messages"))
    return result


def _read_preference_row(where: str, row: dict, layout: str, data: DataConfig) -> PreferenceRow:
    """One row in `layout` read; ValueError with what is wrong."""
    f = data.fields
    margin = row.get(f.margin)
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float))):
        raise ValueError(f"field {f.margin!r} is {type(margin).__name__}, not a number")
    margin = None if margin is None else float(margin)
    if layout == "kto":
        label = row[f.label]
        if not isinstance(label, bool):
            raise ValueError(f"field {f.label!r} is {label!r}, not true or false (is the completion desirable?)")
        return PreferenceRow(where, _text_or_messages(row[f.prompt], f"field {f.prompt!r}"),
                             [_text_or_messages(row[f.completion], f"field {f.completion!r}")], [label])
    if layout == "sharegpt":
        key = f.conversations
        prompt = sharegpt_messages([(where, {key: row[key]})], data)[0]
        pair = []
        for name in (f.chosen, f.rejected):
            turns = row[name] if isinstance(row[name], list) else [row[name]]
            pair.append(sharegpt_messages([(where, {key: turns})], data)[0])
        return PreferenceRow(where, prompt, pair, [True, False], margin)
    if layout == "alpaca":
        instruction = row[f.instruction]
        pair = [row[f.chosen], row[f.rejected]]
        if not all(isinstance(text, str) for text in [instruction, *pair]):
            raise ValueError(f"fields {f.instruction!r}, {f.chosen!r} and {f.rejected!r} must be strings")
        given = alpaca_inputs([(where, row)], data)[0]
        if data.chat_template is None:
            template = ALPACA_PROMPT if given else ALPACA_PROMPT_NO_INPUT
            return PreferenceRow(where, template.format(instruction=instruction, input=given), pair, [True, False],
                                 margin)
        prompt = [{"role": "user", "content": instruction + (f"\n\n{given}" if given else "")}]
        return PreferenceRow(where, prompt, pair, [True, False], margin)
    pair = [_text_or_messages(row[f.chosen], f"field {f.chosen!r}"),
            _text_or_messages(row[f.rejected], f"field {f.rejected!r}")]
    if layout == "explicit":
        return PreferenceRow(where, _text_or_messages(row[f.prompt], f"field {f.prompt!r}"), pair, [True, False],
                             margin)
    # implicit: the shared leading messages are the prompt
    if not all(isinstance(side, list) for side in pair):
        raise ValueError(f"{f.chosen!r} and {f.rejected!r} are strings and the row has no {f.prompt!r}: without a "
                         "prompt field they must be message lists that open with the prompt's turns")
    shared = 0
    while shared < min(map(len, pair)) and pair[0][shared] == pair[1][shared]:
        shared += 1
    if shared == 0 or shared == len(pair[0]) or shared == len(pair[1]):
        raise ValueError(f"{f.chosen!r} and {f.rejected!r} share {shared} leading messages: the prompt's turns must "
                         "open both, and each must go on with its own completion")
    return PreferenceRow(where, pair[0][:shared], [pair[0][shared:], pair[1][shared:]], [True, False], margin)


def preference_rows(rows: list[tuple[str, dict]], data: DataConfig) -> list[PreferenceRow]:
    """Every row of format "preference" read by its layout; rows in none, or with a bad field, are reported
    with their file and row, the fields they have and the layouts accepted."""
    result, problems = [], []
    f = data.fields
    accepted = "; ".join(f"{', '.join(getattr(f, need) for need in needs)} ({what})"
                         for _, needs, what in PREFERENCE_LAYOUTS)
    for where, row in rows:
        layout = preference_layout(row, data)
        try:
            if layout is None:
                raise LookupError
            read = _read_preference_row(where, row, layout, data)
            for completion in read.completions:
                if isinstance(completion, list) and not any(m["role"] == "assistant" for m in completion):
                    raise ValueError("a completion has no assistant message: nothing to score")
            result.append(read)
        except LookupError:
            problems.append(Problem(f"the row is in no preference layout: its fields are "
                                    f"{', '.join(map(str, row)) or 'none'}", f"{where} (data.format preference)",
                                    f"give each row the fields of one layout: {accepted} (data.fields renames them)"))
        except ValueError as err:
            problems.append(Problem(str(err), f"{where} (data.format preference, layout {layout})",
                                    "fix the row: " + dict((n, w) for n, _, w in PREFERENCE_LAYOUTS)[layout]))
        if len(problems) > MAX_REPORTED:
            problems[MAX_REPORTED:] = [Problem("and more rows like these", "data.format preference")]
            break
    if problems:
        raise UserError(problems)
    return result
