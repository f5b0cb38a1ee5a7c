"""Row sources (jsonl, json, parquet, datasets directories) and their formats, token by token.

A real byte-level BPE tokenizer is trained here on a few sentences and saved with save_pretrained
(tests/tiny_tokenizer.py), so nothing is downloaded. Expected tokens are computed from the pieces
the format joins (prompt, response, the template's segments), independently of dstrain's code.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from dstrain.cli import app
from dstrain.config.schema import RunConfig
from dstrain.data import build_samplers, check_source, data_config
from dstrain.data.sampler import rank_batch
from dstrain.data.tokenized import load_encoded
from dstrain.errors import UserError
from launcher import assert_ok, run_tiny
from tiny_tokenizer import CHATML_MARKED, build_tokenizer

IGNORE = -100
INSTRUCTIONS = Path(__file__).parent.parent / "examples" / "finetune_llama" / "instructions.jsonl"
QA = [("What is the capital of France?\n", "Paris."),
      ("Name three primary colours.\n", "Red, yellow and blue."),
      ("Explain photosynthesis in one sentence.\n", "Plants turn light, water and air into sugar."),
      ("Finish the sentence: the quick brown fox\n", "jumps over the lazy dog.")]
CONVERSATION = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Name three primary colours."},
                {"role": "assistant", "content": "Red, yellow and blue."},
                {"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "Paris."}]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """name -> (directory, loaded tokenizer): ChatML without marks, with {% generation %} marks, with a
    leading special token (as Llama's <s>), and without any chat template."""
    from transformers import AutoTokenizer
    root = tmp_path_factory.mktemp("tokenizers")
    dirs = {"chatml": build_tokenizer(root / "chatml"), "marked": build_tokenizer(root / "marked", CHATML_MARKED),
            "bos": build_tokenizer(root / "bos", bos=True), "plain": build_tokenizer(root / "plain", None)}
    return {name: (str(d), AutoTokenizer.from_pretrained(d)) for name, d in dirs.items()}


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def config(tmp_path: Path, paths, **data) -> RunConfig:
    # One example per row (no packing), so each row shows one example's tokens; tests/test_packing.py packs.
    data = {"source": "jsonl", "paths": [str(p) for p in paths], "seq_len": 48, "eval_fraction": 0.25,
            "cache_dir": str(tmp_path / "cache"), "packing": False, **data}
    return RunConfig.model_validate({"data": data, "model": {"vocab_size": 320}})


def qa_rows(copies: int = 1) -> list[dict]:
    return [{"prompt": p, "response": r} for p, r in QA] * copies


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def unshuffled(sampler):
    """A sampler's items in their stored order (undo the seeded permutation)."""
    order = [sampler.order.item(i) for i in range(sampler.order.n)]
    return [sampler.batch(order.index(item), 1) for item in range(sampler.order.n)]


def problems(err: pytest.ExceptionInfo) -> str:
    return " ".join(str(err.value).split())


# ---------------------------------------------------------------------------------------
# Formats, token by token

def test_text_format_packs_documents_with_eos_between_them(tmp_path, tokenizers):
    directory, tok = tokenizers["chatml"]
    documents = [f"{p}{r}" for p, r in QA] * 4
    cfg = config(tmp_path, [write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in documents])],
                 format="text", tokenizer=directory, seq_len=16)
    expected = [t for d in documents for t in encode(tok, d) + [tok.eos_token_id]]
    assert load_encoded(data_config(cfg)).tokens.tolist() == expected
    train, held_out = build_samplers(cfg)
    cut = int(len(expected) * 0.75)
    windows = [w["input_ids"][0].tolist() for w in unshuffled(train)]
    assert windows == [expected[i * 16:(i + 1) * 16] for i in range(cut // 16)]  # non-overlapping, in order
    assert all(torch.equal(w["input_ids"], w["labels"]) for w in unshuffled(train))  # every token is a label
    assert unshuffled(held_out)[0]["input_ids"][0].tolist() == expected[cut:cut + 16]  # the end is held out


def test_text_format_starts_each_document_with_the_tokenizers_own_bos(tmp_path, tokenizers):
    directory, tok = tokenizers["bos"]
    cfg = config(tmp_path, [write_jsonl(tmp_path / "d.jsonl", [{"body": "Paris."}, {"body": "Red."}])],
                 format="text", tokenizer=directory, fields={"text": "body"})
    bos = eos = tok.eos_token_id  # this tokenizer uses <|endoftext|> for both, as GPT-2 does
    assert load_encoded(data_config(cfg)).tokens.tolist() == [bos, *encode(tok, "Paris."), eos,
                                                               bos, *encode(tok, "Red."), eos]


def test_prompt_response_masks_exactly_the_prompt_tokens(tmp_path, tokenizers):
    directory, tok = tokenizers["chatml"]
    cfg = config(tmp_path, [write_jsonl(tmp_path / "qa.jsonl", qa_rows())], format="prompt_response",
                 tokenizer=directory, seq_len=64)
    train, held_out = build_samplers(cfg)
    rows = unshuffled(train) + unshuffled(held_out)
    for (prompt, response), batch in zip(QA, rows):
        p, r, eos, pad = encode(tok, prompt), encode(tok, response), tok.eos_token_id, tok.pad_token_id
        padding = 64 - len(p) - len(r) - 1
        assert batch["input_ids"][0].tolist() == p + r + [eos] + [pad] * padding
        assert batch["labels"][0].tolist() == [IGNORE] * len(p) + r + [eos] + [IGNORE] * padding


def test_prompt_response_keeps_the_bos_before_the_prompt_and_masks_it(tmp_path, tokenizers):
    directory, tok = tokenizers["bos"]
    cfg = config(tmp_path, [write_jsonl(tmp_path / "qa.jsonl", qa_rows())], format="prompt_response",
                 tokenizer=directory)
    encoded = load_encoded(data_config(cfg))
    p, r, eos = encode(tok, QA[0][0]), encode(tok, QA[0][1]), tok.eos_token_id
    first = slice(int(encoded.offsets[0]), int(encoded.offsets[1]))
    assert encoded.ids[first].tolist() == [tok.bos_token_id] + p + r + [eos]
    assert encoded.labels[first].tolist() == [IGNORE] * (1 + len(p)) + r + [eos]


def chat_segments(marked: bool) -> list[tuple[str, bool]]:
    """The ChatML rendering of CONVERSATION cut into (text, is it learned): the assistant's content and
    end-of-turn marker (and the newline after it, which the unmarked template's turn ends with)."""
    tail = "" if marked else "\n"
    return [("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nName three primary colours.<|im_end|>\n"
             "<|im_start|>assistant\n", False), ("Red, yellow and blue.<|im_end|>" + tail, True),
            (("\n" if marked else "") + "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
             "<|im_start|>assistant\n", False), ("Paris.<|im_end|>" + tail, True), ("\n" if marked else "", False)]


@pytest.mark.parametrize("template", ["chatml", "marked"])
def test_chat_masks_everything_but_the_assistant_turns(tmp_path, tokenizers, template):
    """Without {% generation %} marks the turns are found by rendering prefixes; with them, by
    transformers' assistant mask: both give the assistant's tokens and nothing else."""
    directory, tok = tokenizers[template]
    cfg = config(tmp_path, [write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}] * 4)],
                 format="chat", tokenizer=directory, seq_len=160)
    ids, labels = [], []
    for text, learned in chat_segments(template == "marked"):
        ids += encode(tok, text)
        labels += encode(tok, text) if learned else [IGNORE] * len(encode(tok, text))
    assert tok.decode(ids) == tok.apply_chat_template(CONVERSATION, tokenize=False)  # the segments are the rendering
    batch = build_samplers(cfg)[0].batch(0, 1)
    assert batch["input_ids"][0, :len(ids)].tolist() == ids
    assert batch["labels"][0].tolist() == labels + [IGNORE] * (160 - len(ids))


def test_a_chat_template_file_replaces_the_tokenizers(tmp_path, tokenizers):
    directory, tok = tokenizers["plain"]  # no template of its own
    (tmp_path / "chatml.jinja").write_text(tokenizers["chatml"][1].chat_template)
    cfg = config(tmp_path, [write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}] * 4)],
                 format="chat", tokenizer=directory, seq_len=160, chat_template=str(tmp_path / "chatml.jinja"))
    labels = build_samplers(cfg)[0].batch(0, 1)["labels"][0]
    assert tok.decode([t for t in labels.tolist() if t != IGNORE]) == "Red, yellow and blue.<|im_end|>\nParis.<|im_end|>\n"


def test_byte_tokenizer_ends_each_response_with_nul(tmp_path):
    cfg = config(tmp_path, [write_jsonl(tmp_path / "qa.jsonl", qa_rows())], format="prompt_response",
                 tokenizer="byte")
    encoded = load_encoded(data_config(cfg))
    first = slice(int(encoded.offsets[0]), int(encoded.offsets[1]))
    prompt, response = (s.encode() for s in QA[0])
    assert encoded.ids[first].tolist() == list(prompt + response) + [0]
    assert encoded.labels[first].tolist() == [IGNORE] * len(prompt) + list(response) + [0]


def test_long_examples_are_cut_to_seq_len_and_those_left_without_a_response_dropped(tmp_path, tokenizers):
    directory, tok = tokenizers["chatml"]
    long_prompt = "the quick brown fox " * 20
    rows = qa_rows(2) + [{"prompt": "Say it.\n", "response": "Paris. " * 30}, {"prompt": long_prompt, "response": "Red."}]
    cfg = config(tmp_path, [write_jsonl(tmp_path / "qa.jsonl", rows)], format="prompt_response", tokenizer=directory,
                 eval_fraction=0.1, seq_len=64)
    warnings = " ".join(check_source(cfg))
    assert "2 of 10 examples are longer than data.seq_len=64" in warnings  # the long response and the long prompt
    assert "1 examples have no response" in warnings  # the long prompt leaves no response within 64 tokens
    encoded = load_encoded(data_config(cfg))
    assert len(encoded.offsets) - 1 == 9 and int(np.diff(encoded.offsets).max()) == 64
    cut = slice(int(encoded.offsets[8]), int(encoded.offsets[9]))  # the long response, cut: still its own tokens
    prompt, response = encode(tok, "Say it.\n"), encode(tok, "Paris. " * 30)
    assert encoded.labels[cut].tolist() == [IGNORE] * len(prompt) + response[:64 - len(prompt)]


def masked_loss(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(the model's loss, the mean cross-entropy of its logits at t against labels[t + 1] wherever that
    label is not -100, computed here token by token)."""
    captured = []
    hook = model.head.register_forward_hook(lambda _m, _a, out: captured.append(out))
    loss = model(batch)
    hook.remove()
    logits, labels = captured[0], batch["labels"]
    rows, length = labels.shape
    per_token = [F.cross_entropy(logits[b, t], labels[b, t + 1]) for b in range(rows) for t in range(length - 1)
                 if labels[b, t + 1] != IGNORE]
    return loss, torch.stack(per_token).mean()


def test_the_built_in_gpt_takes_the_mean_loss_over_unmasked_labels_shifted_by_one(tmp_path, tokenizers):
    from dstrain.models.gpt import GPT
    directory, _ = tokenizers["chatml"]
    cfg = config(tmp_path, [write_jsonl(tmp_path / "qa.jsonl", qa_rows())], format="prompt_response",
                 tokenizer=directory)
    torch.manual_seed(0)
    loss, expected = masked_loss(GPT(320, 48, 32, 2, 2), build_samplers(cfg)[0].batch(0, 3))
    assert torch.allclose(loss, expected, atol=1e-6)


# Templates in the form Llama 3, Mistral and Gemma instruct tokenizers ship them (their markers are plain
# text to the tiny tokenizer, which changes nothing here): no {% generation %} marks, so the prefix method.
LLAMA3 = ("{% for m in messages %}{% set content = '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + "
          "m['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
          "{% endif %}{{ content }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
MISTRAL = ("{{ bos_token }}{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
           "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
           "{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
           "{% else %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}")
GEMMA = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}{% set role = 'model' %}"
         "{% else %}{% set role = m['role'] %}{% endif %}"
         "{{ '<start_of_turn>' + role + '\\n' + m['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")


@pytest.mark.parametrize("template, learned", [
    (LLAMA3, "Red, yellow and blue.<|eot_id|>Paris.<|eot_id|>"),
    (MISTRAL, "Red, yellow and blue.<|endoftext|>Paris.<|endoftext|>"),
    (GEMMA, "Red, yellow and blue.<end_of_turn>\nParis.<end_of_turn>\n")], ids=["llama3", "mistral", "gemma"])
def test_chat_templates_of_other_families_learn_exactly_the_assistant_turns(tmp_path, tokenizers, template, learned):
    directory, tok = tokenizers["bos"]
    (tmp_path / "template.jinja").write_text(template)
    conversation = CONVERSATION[1:]  # user, assistant, user, assistant: Mistral's alternation rule
    chats = write_jsonl(tmp_path / "chat.jsonl", [{"messages": conversation}] * 4)
    cfg = config(tmp_path, [chats], format="chat", tokenizer=directory, seq_len=256,
                 chat_template=str(tmp_path / "template.jinja"))
    batch = build_samplers(cfg)[0].batch(0, 1)
    ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
    rendered = tok.apply_chat_template(conversation, chat_template=template, tokenize=False)
    assert tok.decode([t for t, label in zip(ids, labels) if label != IGNORE]) == learned
    assert tok.decode(ids).startswith(rendered) and ids[0] == tok.bos_token_id


# ---------------------------------------------------------------------------------------
# Other file kinds read as the same rows

def test_json_parquet_and_datasets_directories_give_the_rows_jsonl_gives(tmp_path, tokenizers):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    directory, _ = tokenizers["chatml"]
    rows = qa_rows()
    (tmp_path / "qa.json").write_text(json.dumps(rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "qa.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(tmp_path / "ds")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows[:1])}) \
        .save_to_disk(tmp_path / "dsdict")
    reference = load_encoded(data_config(config(tmp_path, [write_jsonl(tmp_path / "qa.jsonl", rows)],
                                                format="prompt_response", tokenizer=directory)))
    for source, path in [("json", "qa.json"), ("parquet", "qa.parquet"), ("datasets", "ds"), ("datasets", "dsdict")]:
        got = load_encoded(data_config(config(tmp_path, [tmp_path / path], source=source, format="prompt_response",
                                              tokenizer=directory)))
        assert got.ids.tolist() == reference.ids.tolist() and got.labels.tolist() == reference.labels.tolist(), source


def test_a_datasets_directory_without_the_named_split_names_the_splits(tmp_path):
    import datasets
    datasets.DatasetDict({"validation": datasets.Dataset.from_list(qa_rows())}).save_to_disk(tmp_path / "dsdict")
    with pytest.raises(UserError) as err:
        check_source(config(tmp_path, [tmp_path / "dsdict"], source="datasets", format="prompt_response",
                            tokenizer="byte"))
    assert "data.split" in problems(err) and "no split 'train' (it has: validation)" in problems(err)


def test_a_byte_order_mark_is_read_past_and_a_file_that_is_not_utf8_is_named(tmp_path):
    marked = tmp_path / "bom.jsonl"
    marked.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\r\n" for r in qa_rows()).encode())
    encoded = load_encoded(data_config(config(tmp_path, [marked], format="prompt_response", tokenizer="byte")))
    assert bytes(encoded.ids[:int(encoded.offsets[1])].tolist()).startswith(QA[0][0].encode())
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(json.dumps(qa_rows()[0]).encode() + b"\n" + '{"prompt": "caf\xe9", "response": "x"}\n'.encode("latin-1"))
    with pytest.raises(UserError) as err:
        check_source(config(tmp_path, [latin1], format="prompt_response", tokenizer="byte"))
    assert f"{latin1}: not UTF-8 text" in problems(err) and "fix: save the file as UTF-8" in problems(err)


# ---------------------------------------------------------------------------------------
# Order, sharding and the held-out split

def test_the_samples_of_a_step_do_not_depend_on_the_number_of_ranks(tmp_path, tokenizers):
    directory, _ = tokenizers["chatml"]
    cfg = config(tmp_path, [write_jsonl(tmp_path / "qa.jsonl", qa_rows(10))], format="prompt_response",
                 tokenizer=directory, eval_fraction=0.1)
    train, _ = build_samplers(cfg)
    for step in (0, 3, 7):  # 36 train examples, 8 per step: step 7 is in the second epoch
        one_rank = [rank_batch(train, step, m, 0, 1, 2, 4) for m in range(4)]
        four_ranks = [rank_batch(train, step, 0, r, 4, 2, 1) for r in range(4)]
        for a, b in zip(one_rank, four_ranks):
            assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])


def test_the_last_examples_are_held_out_and_never_trained_on(tmp_path):
    rows = [{"prompt": f"Question {i}?\n", "response": f"Answer {i}."} for i in range(20)]
    cfg = config(tmp_path, [write_jsonl(tmp_path / "qa.jsonl", rows)], format="prompt_response", tokenizer="byte")
    train, held_out = build_samplers(cfg)
    decode = lambda batch: bytes(t for t in batch["input_ids"][0].tolist() if t).decode()  # noqa: E731
    seen = {decode(train.batch(i, 1)) for i in range(2 * train.order.n)}  # two epochs
    assert seen == {f"Question {i}?\nAnswer {i}." for i in range(15)}
    assert {decode(b) for b in unshuffled(held_out)} == {f"Question {i}?\nAnswer {i}." for i in range(15, 20)}


# ---------------------------------------------------------------------------------------
# The tokenize-once cache

def test_rows_are_tokenized_once_and_read_back_from_the_cache(tmp_path, tokenizers):
    directory, _ = tokenizers["chatml"]
    path = write_jsonl(tmp_path / "qa.jsonl", qa_rows())
    cfg = config(tmp_path, [path], format="prompt_response", tokenizer=directory)
    first = load_encoded(data_config(cfg))
    entries = list((tmp_path / "cache").iterdir())
    assert len(entries) == 1 and (entries[0] / "meta.json").is_file()  # no staging directory left behind
    again = load_encoded(data_config(cfg))
    assert isinstance(again.ids, np.memmap) and again.ids.tolist() == first.ids.tolist()
    write_jsonl(path, qa_rows()[::-1])  # new contents: a new entry, not the stale one
    assert load_encoded(data_config(cfg)).ids.tolist() != first.ids.tolist()
    assert len(list((tmp_path / "cache").iterdir())) == 2


def test_the_default_tokenizer_of_an_hf_model_is_its_own(tmp_path):
    cfg = RunConfig.model_validate({"model": {"name": "hf:/models/tiny-llama"}, "data": {"source": "jsonl"}})
    assert data_config(cfg).tokenizer == "/models/tiny-llama"
    assert data_config(RunConfig.model_validate({"data": {"source": "jsonl"}})).tokenizer == "byte"
    explicit = RunConfig.model_validate({"model": {"name": "hf:/models/x"}, "data": {"tokenizer": "gpt2"}})
    assert data_config(explicit).tokenizer == "gpt2"


# ---------------------------------------------------------------------------------------
# Bad input: exit 2 at --dry-run, naming the file, the row, the key and the fix; nothing cached

def bad_inputs(tmp_path: Path, tokenizers) -> dict[str, tuple[list[str], list[str]]]:
    """name -> (--set items, parts the message must contain)."""
    good = write_jsonl(tmp_path / "good.jsonl", qa_rows(3))
    no_field = write_jsonl(tmp_path / "no_field.jsonl", qa_rows(1) + [{"prompt": "Hi?", "answer": "Hello."}])
    no_assistant = write_jsonl(tmp_path / "no_assistant.jsonl", [{"messages": CONVERSATION}] * 2 +
                               [{"messages": CONVERSATION[:2]}])
    malformed = tmp_path / "malformed.jsonl"
    malformed.write_text(json.dumps(qa_rows()[0]) + "\n" + '{"prompt": "Hi?", "response": "Hello."\n')
    chat = [f"data.tokenizer={tokenizers['chatml'][0]}", "data.format=chat"]
    return {
        "missing field": ([f"data.paths=[{no_field}]", "data.format=prompt_response"],
                          [f"{no_field} line 5", "data.fields.response", "no field 'response' (its fields: prompt, answer)",
                           "fix: set data.fields.response"]),
        "no assistant turn": ([f"data.paths=[{no_assistant}]", *chat],
                              [f"{no_assistant} line 3", "no assistant turn (roles: system, user)", "fix:"]),
        "malformed line": ([f"data.paths=[{malformed}]", "data.format=prompt_response"],
                           [f"{malformed} line 2", "not valid JSON", "fix: fix that line"]),
        "missing file": ([f"data.paths=[{tmp_path / 'absent.jsonl'}]"], ["data.paths", "no file matches"]),
        "no chat template": ([f"data.paths=[{good}]", f"data.tokenizer={tokenizers['plain'][0]}", "data.format=chat"],
                             ["data.tokenizer / data.chat_template", "has no chat template", "fix:"]),
    }


@pytest.mark.parametrize("case", ["missing field", "no assistant turn", "malformed line", "missing file",
                                  "no chat template"])
def test_bad_rows_stop_the_dry_run_with_exit_2(tmp_path, tokenizers, monkeypatch, case):
    sets, expected = bad_inputs(tmp_path, tokenizers)[case]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.delenv("PL_DEEPSPEED_CONFIG_PATH", raising=False)
    args = ["run", "--dry-run", "--accelerator", "cpu", "--gpus", "2", "--run-dir", str(tmp_path / "run")]
    for item in ["data.source=jsonl", f"data.cache_dir={tmp_path / 'cache'}", "model.vocab_size=320", *sets]:
        args += ["--set", item]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "300"})
    output = " ".join(result.output.split())
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), output
    assert "Traceback" not in output
    for part in expected:
        assert part in output, output
    assert not (tmp_path / "run").exists()
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())  # nothing half-written


def test_a_field_of_the_wrong_type_names_the_row_and_the_type(tmp_path):
    wrong = write_jsonl(tmp_path / "wrong.jsonl", qa_rows() + [{"prompt": 7, "response": "Seven."}])
    with pytest.raises(UserError) as err:
        check_source(config(tmp_path, [wrong], format="prompt_response", tokenizer="byte"))
    assert f"{wrong} line 5 (data.fields.prompt): field 'prompt' is int, not str" in problems(err)


def test_too_few_rows_to_hold_out_eval_fraction_is_reported(tmp_path):
    few = write_jsonl(tmp_path / "few.jsonl", qa_rows()[:3])
    with pytest.raises(UserError) as err:
        check_source(config(tmp_path, [few], format="prompt_response", tokenizer="byte", eval_fraction=0.7))
    assert "data.eval_fraction: 3 examples are too few" in problems(err)


def test_token_ids_beyond_the_built_in_gpts_vocabulary_are_reported_at_dry_run(tmp_path):
    bytes_for_a_tiny_vocab = RunConfig.model_validate({"model": {"vocab_size": 64}, "data": config(
        tmp_path, [write_jsonl(tmp_path / "qa.jsonl", qa_rows())], format="prompt_response", tokenizer="byte").data})
    with pytest.raises(UserError) as err:
        check_source(bytes_for_a_tiny_vocab)
    assert "model.vocab_size: the tokenized data holds token id 121, but model.vocab_size is 64" in problems(err)


def test_chat_with_the_byte_tokenizer_asks_for_a_real_one(tmp_path):
    chats = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}] * 4)
    with pytest.raises(UserError) as err:
        check_source(config(tmp_path, [chats], format="chat", tokenizer="byte"))
    assert "data.tokenizer: format 'chat' needs a Hugging Face tokenizer" in problems(err)


def test_a_template_that_renders_earlier_turns_differently_is_reported_not_guessed(tmp_path, tokenizers):
    """As some reasoning models' templates do: an empty thinking block on the last assistant turn only."""
    (tmp_path / "thinking.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'assistant' and loop.last %}"
        "{{ '<|im_start|>assistant\\n<think></think>' + m['content'] + '<|im_end|>\\n' }}"
        "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    chats = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}] * 4)
    with pytest.raises(UserError) as err:
        check_source(config(tmp_path, [chats], format="chat", tokenizer=tokenizers["chatml"][0], seq_len=160,
                            chat_template=str(tmp_path / "thinking.jinja")))
    assert f"{chats} line 1 (data.chat_template): the chat template renders turn 3 differently" in problems(err)
    assert "{% generation %}" in problems(err)


def test_a_row_format_on_a_token_source_is_an_error_not_ignored(tmp_path):
    (tmp_path / "a.txt").write_text("hello " * 100)
    with pytest.raises(UserError) as err:
        check_source(RunConfig.model_validate({"data": {"source": "text", "paths": [str(tmp_path / "a.txt")],
                                                        "format": "prompt_response"}}))
    assert "data.format: data.format 'prompt_response' reads rows of data files" in problems(err)


# ---------------------------------------------------------------------------------------
# The shipped example

def test_the_data_example_config_passes_every_check_at_dry_run(tmp_path, monkeypatch):
    monkeypatch.chdir(INSTRUCTIONS.parent.parent.parent)  # the example's paths are relative to the repository
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    result = CliRunner().invoke(app, ["run", "--config", "examples/data/config.yaml", "--dry-run", "--accelerator",
                                      "cpu", "--gpus", "2"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert "model: gpt" in result.output
    assert len(list((tmp_path / "dstrain" / "tokenized").iterdir())) == 1  # tokenized, cached for the ranks


# ---------------------------------------------------------------------------------------
# Through the real launcher

@pytest.mark.integration
def test_a_prompt_response_run_on_two_ranks_learns_from_the_responses_and_resumes_exactly(tmp_path):
    """The shipped instructions.jsonl, the built-in tiny GPT, 2 CPU ranks: the loss at step 1 is the
    masked loss of the initial weights on the two ranks' batches, computed here; it falls; the rows
    were tokenized once (by the launcher, before the ranks); a resume from step 3 repeats steps 4-6."""
    from dstrain import rundir
    from dstrain.models.gpt import GPT
    from dstrain.rank.runtime import seed_everything

    texts = tuple(row["prompt"] + row["response"] for row in map(json.loads, INSTRUCTIONS.read_text().splitlines()))
    tokenizer = build_tokenizer(tmp_path / "tok", texts=texts, vocab_size=600)
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    sets = ("data.source=jsonl", f"data.paths=[{INSTRUCTIONS}]", "data.format=prompt_response",
            f"data.tokenizer={tokenizer}", f"data.cache_dir={cache}", "data.seq_len=96", "data.eval_fraction=0.1",
            "model.vocab_size=600", "train.max_steps=6", "train.save_every=3", "train.log_every=1",
            "train.eval_every=6", "train.lr=3e-3", "train.warmup_steps=0", "train.schedule=constant")
    assert_ok(run_tiny(run_dir, "stage2", *sets))
    first = rows_of(run_dir)
    assert sorted(first) == [1, 2, 3, 4, 5, 6] and all(np.isfinite(v) for v in first.values())
    assert first[6] < first[1]  # it learns
    evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if "eval_loss" in line]
    assert len(evals) == 1 and np.isfinite(evals[0]["eval_loss"])  # the held-out examples, evaluated at step 6

    config, _, _ = rundir.read(run_dir)
    seed_everything(config.train.seed)  # as each rank does right before building the model
    m = config.model
    model = GPT(m.vocab_size, config.data.seq_len, m.d_model, m.n_layer, m.n_head)
    train, _ = build_samplers(config)
    micro = config.train.micro_batch_size
    with torch.no_grad():
        rank_losses = [masked_loss(model, rank_batch(train, 0, 0, rank, 2, micro, 1)) for rank in (0, 1)]
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in rank_losses)
    assert first[1] == pytest.approx(float(sum(b for _, b in rank_losses)) / 2, rel=1e-4)
    assert len(list(cache.iterdir())) == 1  # one entry: the ranks loaded what the launcher encoded

    assert_ok(run_tiny(run_dir, "stage2", *sets, resume="step00000003"))
    again = rows_of(run_dir, after_line=len(first))
    assert sorted(again) == [4, 5, 6]
    for step in (4, 5, 6):
        assert again[step] == pytest.approx(first[step], rel=1e-5), step
    assert len(list(cache.iterdir())) == 1


def rows_of(run_dir: Path, after_line: int = 0) -> dict[int, float]:
    """step -> training loss from metrics.jsonl, from the rows after the first `after_line` loss rows."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in [r for r in rows if "loss" in r][after_line:]}
