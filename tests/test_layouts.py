"""Formats "alpaca" and "sharegpt", and the named chat templates, token by token.

The tiny BPE tokenizer of tests/tiny_tokenizer.py is trained here (ChatML special tokens, no download).
Expected tokens are built from the pieces each layout joins, written out in the test, independently of
dstrain's code.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dstrain.cli import app
from dstrain.config.schema import RunConfig
from dstrain.data.tokenized import encode_rows, load_encoder
from dstrain.errors import UserError
from tiny_tokenizer import build_tokenizer
from test_data_rows import GEMMA, LLAMA3, MISTRAL  # the families' own templates, as their tokenizers ship them

IGNORE = -100
CONVERSATION = [{"role": "user", "content": "Name three primary colours."},
                {"role": "assistant", "content": "Red, yellow and blue."},
                {"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "Paris."}]


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    return {"plain": str(build_tokenizer(root / "plain", None)), "bos": str(build_tokenizer(root / "bos", None, bos=True)),
            "chatml": str(build_tokenizer(root / "chatml"))}


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def data_config(tmp_path, rows, **data):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    return RunConfig.model_validate({"data": {"source": "jsonl", "paths": [str(path)], "seq_len": 512,
                                              "cache_dir": str(tmp_path / "cache"), **data}}).data


def examples_of(data):
    """[(ids, labels)] of every encoded example, in row order."""
    encoded = encode_rows(data, load_encoder(data))
    bounds = list(zip(encoded.offsets[:-1], encoded.offsets[1:]))
    return [(encoded.ids[a:b].tolist(), encoded.labels[a:b].tolist()) for a, b in bounds], encoded


def learned(tok, ids, labels) -> str:
    return tok.decode([t for t, label in zip(ids, labels) if label != IGNORE])


def test_alpaca_prompts_with_and_without_input_and_learns_only_the_output(tmp_path, tokenizer_dirs):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer_dirs["plain"])
    rows = [{"instruction": "Name three primary colours.", "input": "", "output": "Red, yellow and blue."},
            {"instruction": "Translate to French.", "input": "the capital", "output": "la capitale"},
            {"instruction": "Say hello.", "output": "Hello."}]  # no input field at all
    (first, second, third), encoded = examples_of(data_config(tmp_path, rows, format="alpaca",
                                                              tokenizer=tokenizer_dirs["plain"]))
    no_input = ("Below is an instruction that describes a task. Write a response that appropriately completes the "
                "request.\n\n### Instruction:\nName three primary colours.\n\n### Response:\n")
    with_input = ("Below is an instruction that describes a task, paired with an input that provides further context. "
                  "Write a response that appropriately completes the request.\n\n### Instruction:\nTranslate to "
                  "French.\n\n### Input:\nthe capital\n\n### Response:\n")
    encode = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos = tok.eos_token_id
    for (ids, labels), prompt, output in ((first, no_input, "Red, yellow and blue."),
                                          (second, with_input, "la capitale")):
        assert ids == encode(prompt) + encode(output) + [eos]
        assert labels == [IGNORE] * len(encode(prompt)) + encode(output) + [eos]
    assert learned(tok, *third) == "Hello.<|endoftext|>" and encoded.format == "alpaca"


def test_alpaca_with_a_chat_template_is_a_user_turn_and_an_assistant_turn(tmp_path, tokenizer_dirs):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer_dirs["plain"])
    rows = [{"question": "Translate to French.", "context": "the capital", "answer": "la capitale"}]
    ((ids, labels),), _ = examples_of(data_config(
        tmp_path, rows, format="alpaca", tokenizer=tokenizer_dirs["plain"], chat_template="chatml",
        fields={"instruction": "question", "input": "context", "output": "answer"}))
    assert tok.decode(ids) == ("<|im_start|>user\nTranslate to French.\n\nthe capital<|im_end|>\n"
                               "<|im_start|>assistant\nla capitale<|im_end|>\n")
    assert learned(tok, ids, labels) == "la capitale<|im_end|>"


def test_sharegpt_maps_speakers_to_roles_and_learns_the_assistant_turns(tmp_path, tokenizer_dirs):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer_dirs["chatml"])  # its own template: ChatML
    rows = [{"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi?"},
                               {"from": "gpt", "value": "Hello."}, {"from": "human", "value": "Colours?"},
                               {"from": "gpt", "value": "Red."}]}]
    ((ids, labels),), encoded = examples_of(data_config(tmp_path, rows, format="sharegpt",
                                                        tokenizer=tokenizer_dirs["chatml"]))
    assert tok.decode(ids) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n"
                               "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nColours?<|im_end|>\n"
                               "<|im_start|>assistant\nRed.<|im_end|>\n")
    assert learned(tok, ids, labels) == "Hello.<|im_end|>\nRed.<|im_end|>\n"  # the prefix method: turn + newline
    assert encoded.format == "sharegpt"


def test_sharegpt_keys_and_speaker_names_are_configurable(tmp_path, tokenizer_dirs):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer_dirs["chatml"])
    rows = [{"dialog": [{"speaker": "customer", "text": "Hi?"}, {"speaker": "agent", "text": "Hello."}]}]
    ((ids, labels),), _ = examples_of(data_config(
        tmp_path, rows, format="sharegpt", tokenizer=tokenizer_dirs["chatml"],
        fields={"conversations": "dialog", "role": "speaker", "content": "text",
                "roles": {"customer": "user", "agent": "assistant"}}))
    assert learned(tok, ids, labels).startswith("Hello.<|im_end|>")


def test_a_sharegpt_speaker_without_a_role_names_the_row_and_the_key(tmp_path, tokenizer_dirs):
    rows = [{"conversations": [{"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "Hello."}]},
            {"conversations": [{"from": "narrator", "value": "Once."}, {"from": "gpt", "value": "Upon."}]}]
    data = data_config(tmp_path, rows, format="sharegpt", tokenizer=tokenizer_dirs["chatml"])
    with pytest.raises(UserError) as err:
        encode_rows(data, load_encoder(data))
    text = " ".join(str(err.value).split())
    assert "rows.jsonl line 2 (data.fields.roles)" in text and "'narrator'" in text and "add 'narrator'" in text


@pytest.mark.parametrize("name, official, learned_text", [
    ("llama3", LLAMA3, "Red, yellow and blue.<|eot_id|>Paris.<|eot_id|>"),
    ("mistral", MISTRAL, "Red, yellow and blue.<|endoftext|>Paris.<|endoftext|>"),
    ("gemma", GEMMA, "Red, yellow and blue.<end_of_turn>Paris.<end_of_turn>"),
    ("chatml", None, "Red, yellow and blue.<|im_end|>Paris.<|im_end|>"),
    ("qwen2", None, "Red, yellow and blue.<|im_end|>Paris.<|im_end|>")])
def test_named_templates_render_as_the_family_does_and_mark_exactly_the_answers(tmp_path, tokenizer_dirs, name,
                                                                                official, learned_text):
    """For a tokenizer without a template: the named template renders what the family's own template
    renders, and its {% generation %} marks make exactly the answers and their end markers learned."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer_dirs["bos"])
    ((ids, labels),), _ = examples_of(data_config(tmp_path, [{"messages": CONVERSATION}], format="chat",
                                                  tokenizer=tokenizer_dirs["bos"], chat_template=name))
    assert learned(tok, ids, labels) == learned_text
    if official is not None:
        assert tok.decode(ids) == tok.apply_chat_template(CONVERSATION, chat_template=official, tokenize=False)
    if name == "qwen2":  # Qwen2's default system message when the conversation has none
        assert tok.decode(ids).startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")


def test_system_messages_open_the_first_user_turn_where_the_family_has_no_system_role(tmp_path, tokenizer_dirs):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer_dirs["plain"])
    conversation = [{"role": "system", "content": "Be brief."}, *CONVERSATION[:2]]
    for name, expected in (("mistral", "[INST] Be brief.\n\nName three primary colours. [/INST]"),
                           ("gemma", "<start_of_turn>user\nBe brief.\n\nName three primary colours.<end_of_turn>")):
        ((ids, _),), _ = examples_of(data_config(tmp_path / name, [{"messages": conversation}], format="chat",
                                                 tokenizer=tokenizer_dirs["plain"], chat_template=name))
        assert tok.decode(ids).startswith(expected), name


def test_a_tokenizer_without_a_template_is_told_the_names(tmp_path, tokenizer_dirs):
    data = data_config(tmp_path, [{"messages": CONVERSATION}], format="chat", tokenizer=tokenizer_dirs["plain"])
    with pytest.raises(UserError) as err:
        encode_rows(data, load_encoder(data))
    assert "chatml" in str(err.value) and "llama3" in str(err.value) and "data.chat_template" in str(err.value)
    data = data_config(tmp_path, [{"messages": CONVERSATION}], format="chat", tokenizer=tokenizer_dirs["plain"],
                       chat_template="chatml3")
    with pytest.raises(UserError) as err:
        encode_rows(data, load_encoder(data))
    assert "neither a template name nor a file" in str(err.value)


def test_the_tokenizers_own_template_is_used_when_none_is_named(tmp_path, tokenizer_dirs):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer_dirs["chatml"])
    ((ids, _),), _ = examples_of(data_config(tmp_path, [{"messages": CONVERSATION}], format="chat",
                                             tokenizer=tokenizer_dirs["chatml"]))
    assert tok.decode(ids) == tok.apply_chat_template(CONVERSATION, tokenize=False)


def test_the_dry_run_checks_warn_of_an_ignored_template_and_of_markers_the_tokenizer_lacks(tmp_path, tokenizer_dirs):
    from dstrain.data import check_source

    def run_config(rows, **data):
        return RunConfig.model_validate({"data": data_config(tmp_path, rows, **data).model_dump(),
                                         "model": {"vocab_size": 320}})
    qa = [{"prompt": f"Q{i}?\n", "response": "A."} for i in range(8)]
    warnings = check_source(run_config(qa, format="prompt_response", tokenizer="byte", chat_template="absent.jinja"))
    assert any("data.chat_template is ignored by format 'prompt_response'" in w for w in warnings)
    chats = [{"messages": CONVERSATION}] * 8
    warnings = check_source(run_config(chats, format="chat", tokenizer=tokenizer_dirs["chatml"], chat_template="llama3"))
    assert any("<|start_header_id|>, <|end_header_id|>, <|eot_id|> are not a token" in w for w in warnings)
    assert not any("not a token" in w for w in check_source(
        run_config(chats, format="chat", tokenizer=tokenizer_dirs["chatml"], chat_template="chatml")))
