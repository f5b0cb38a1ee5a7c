"""Format "preference": each published layout read into prompt + chosen and prompt + rejected examples
(labels on the completions only), bad rows reported with file, row and fields, pairs kept whole when cut,
and pairs packed into rows whose segment sums through a small built-in GPT equal the unpacked ones.
In-process, CPU, a few seconds (the tiny tokenizer of tests/tiny_tokenizer.py is trained once here)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dstrain.config.schema import RunConfig
from dstrain.data import split_encoded
from dstrain.data.layouts import ALPACA_PROMPT_NO_INPUT, PREFERENCE_LAYOUTS
from dstrain.data.preference import fit_group
from dstrain.data.sampler import PreferenceSampler
from dstrain.data.tokenized import encode_rows, load_encoder
from dstrain.errors import UserError
from tiny_tokenizer import CHATML_MARKED, build_tokenizer

IGNORE = -100


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return str(build_tokenizer(tmp_path_factory.mktemp("tok") / "chatml"))


def data_config(tmp_path: Path, rows: list, **data):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    settings = {"source": "jsonl", "paths": [str(path)], "format": "preference", "seq_len": 256,
                "tokenizer": "byte", "cache_dir": str(tmp_path / "cache"), **data}
    return RunConfig.model_validate({"data": settings}).data


def encode(tmp_path, rows, **data):
    data = data_config(tmp_path, rows, **data)
    return encode_rows(data, load_encoder(data)), data


def examples(encoded):
    return [(encoded.ids[a:b].tolist(), encoded.labels[a:b].tolist())
            for a, b in zip(encoded.offsets[:-1], encoded.offsets[1:])]


def scored(encoded, decode) -> list[str]:
    return [decode([t for t, label in zip(ids, labels) if label != IGNORE]) for ids, labels in examples(encoded)]


def byte_text(ids):
    return bytes(ids).decode()


def test_text_pairs_are_prompt_then_each_completion_with_labels_on_the_completion(tmp_path):
    encoded, _ = encode(tmp_path, [{"prompt": "2+2=", "chosen": "4", "rejected": "5", "margin": 1.5},
                                   {"prompt": "Sky? ", "chosen": "blue", "rejected": "green"}])
    (c0, r0, c1, r1) = examples(encoded)
    assert c0 == (list(b"2+2=4") + [0], [IGNORE] * 4 + [ord("4"), 0])
    assert r0 == (list(b"2+2=5") + [0], [IGNORE] * 4 + [ord("5"), 0])
    assert byte_text(c1[0][:-1]) == "Sky? blue" and byte_text(r1[0][:-1]) == "Sky? green"
    assert encoded.groups.tolist() == [0, 2, 4] and encoded.desirable.tolist() == [1, 0, 1, 0]
    assert encoded.margins[0] == 1.5 and np.isnan(encoded.margins[1])
    assert encoded.stats["pairs"] == 2 and encoded.stats["unpaired"] == 0


def test_every_published_layout_scores_only_its_completions(tmp_path, tokenizer_dir):
    """UltraFeedback-binarized (implicit prompt: the shared leading turns), explicit conversational prompt,
    LLaMA-Factory's Alpaca and ShareGPT pairs, and KTO's unpaired rows, one file; ChatML template."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    user = {"role": "user", "content": "Name three primary colours."}
    earlier = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    rows = [
        {"chosen": [*earlier, user, {"role": "assistant", "content": "Red, yellow and blue."}],
         "rejected": [*earlier, user, {"role": "assistant", "content": "Green."}]},
        {"prompt": [user], "chosen": [{"role": "assistant", "content": "Red."}],
         "rejected": [{"role": "assistant", "content": "Pink."}]},
        {"instruction": "Say hello.", "input": "", "chosen": "Hello.", "rejected": "Bye."},
        {"conversations": [{"from": "human", "value": "What is the capital of France?"}],
         "chosen": {"from": "gpt", "value": "Paris."}, "rejected": {"from": "gpt", "value": "Lyon."}},
        {"prompt": "Say hello.", "completion": "Hello.", "label": True},
    ]
    encoded, _ = encode(tmp_path, rows, tokenizer=tokenizer_dir, seq_len=1024)
    # as format "chat": an assistant turn is learned through its end-of-turn marker and the newline after it
    assert scored(encoded, tok.decode) == [
        "Red, yellow and blue.<|im_end|>\n", "Green.<|im_end|>\n",  # the earlier assistant turn is prompt
        "Red.<|im_end|>\n", "Pink.<|im_end|>\n",
        "Hello.<|endoftext|>", "Bye.<|endoftext|>",  # Alpaca without a template: the Alpaca prompt
        "Paris.<|im_end|>\n", "Lyon.<|im_end|>\n",
        "Hello.<|endoftext|>"]
    texts = [tok.decode(ids) for ids, _ in examples(encoded)]
    assert texts[0].startswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>")
    assert texts[4] == ALPACA_PROMPT_NO_INPUT.format(instruction="Say hello.") + "Hello.<|endoftext|>"
    assert encoded.groups.tolist() == [0, 2, 4, 6, 8, 9]
    assert encoded.desirable.tolist() == [1, 0, 1, 0, 1, 0, 1, 0, 1]
    assert encoded.stats["unpaired"] == 1 and "line 5" in encoded.stats["first_unpaired"]


def test_a_template_with_generation_marks_scores_the_completion_alone(tmp_path, tokenizer_dir):
    template = tmp_path / "marked.jinja"
    template.write_text(CHATML_MARKED)
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
             {"role": "user", "content": "Sky?"}]
    rows = [{"chosen": [*turns, {"role": "assistant", "content": "Blue."}],
             "rejected": [*turns, {"role": "assistant", "content": "Green."}]}]
    encoded, _ = encode(tmp_path, rows, tokenizer=tokenizer_dir, chat_template=str(template))
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert scored(encoded, tok.decode) == ["Blue.<|im_end|>", "Green.<|im_end|>"]


def test_a_row_without_a_pair_names_the_file_the_row_and_its_fields(tmp_path):
    rows = [{"prompt": "a", "chosen": "b", "rejected": "c"}, {"prompt": "a", "chosen": "b"},
            {"prompt": "a", "completion": "b", "label": "yes"}, {"chosen": "ab", "rejected": "ac"}]
    with pytest.raises(UserError) as caught:
        encode(tmp_path, rows)
    first, second, third = caught.value.problems
    assert "line 4" in third.where and "without a prompt field they must be message lists" in third.message
    assert "pairs.jsonl line 2" in first.where and "its fields are prompt, chosen" in first.message
    assert all(f"{', '.join(needs)}" in first.fix for _, needs, _ in PREFERENCE_LAYOUTS if "conversations" not in needs)
    assert "pairs.jsonl line 3" in second.where and "'label' is 'yes', not true or false" in second.message


def test_pairs_cut_to_fit_one_row_together_and_dropped_whole_when_a_completion_is_gone(tmp_path):
    assert fit_group([10, 30], 32) == [10, 22] and fit_group([30, 10], 32) == [22, 10]
    assert fit_group([20, 20], 32) == [16, 16] and fit_group([40], 32) == [32]
    rows = [{"prompt": "p", "chosen": "c" * 20, "rejected": "r" * 30},
            {"prompt": "P" * 30, "chosen": "c", "rejected": "r"},  # the prompt leaves no completion token
            {"prompt": "p", "chosen": "c", "rejected": "r"}]
    encoded, _ = encode(tmp_path, rows, seq_len=32)
    lengths = np.diff(encoded.offsets).tolist()
    assert lengths == [16, 16, 3, 3] and encoded.stats["truncated"] == 4 and encoded.stats["dropped"] == 1


def test_paired_objectives_refuse_kto_rows_naming_the_first(tmp_path):
    from dstrain.data import check_source
    rows = [{"prompt": "a", "chosen": "b", "rejected": "c"}] * 3 + [{"prompt": "a", "completion": "b", "label": False}]
    data = data_config(tmp_path, rows, eval_fraction=0.25)
    config = RunConfig.model_validate({"data": data.model_dump(), "train": {"objective": "dpo"}})
    with pytest.raises(UserError) as caught:
        check_source(config)
    assert "pairs.jsonl line 4" in caught.value.problems[0].where and "set train.objective: kto" in caught.value.problems[0].fix
    kto = RunConfig.model_validate({"data": data.model_dump(), "train": {"objective": "kto"}})
    check_source(kto)  # pairs become one desirable and one undesirable example for KTO


def random_pairs(count: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    letters = "abcdefghij"
    word = lambda n: "".join(rng.choice(list(letters), n))  # noqa: E731
    return [{"prompt": word(rng.integers(1, 12)), "chosen": word(rng.integers(1, 14)),
             "rejected": word(rng.integers(1, 14))} for _ in range(count)]


def segment_sums(model, batch: dict, packed: bool) -> torch.Tensor:
    """Each segment's summed completion log-prob through the GPT: document mask when packed."""
    from dstrain.models import preference_loss as pl
    from dstrain.models.gpt import document_mask
    ids, positions = batch["input_ids"], batch["position_ids"]
    x = model.tok_emb(ids) + model.pos_emb(positions)
    for block in model.blocks:
        x = block(x, document_mask(positions)) if packed else block(x)
    logits = model.head(model.ln_f(x))
    token = pl.token_logps(logits, pl.shift_labels(batch["labels"]))
    segments = pl.shift_segment_ids(batch["example_ids"], batch["labels"])
    return pl.sequence_logps(token, segments, len(batch["desirable"]))


def test_packed_pairs_give_the_unpacked_log_probs_through_a_random_gpt(tmp_path):
    """Pairs packed whole into rows of seq_len: the chosen and rejected sums equal one padded row per
    completion (fp32, 1e-5), no pair crosses a row, and packing fills the rows better."""
    from dstrain.models.gpt import GPT
    seq_len = 48
    encoded, data = encode(tmp_path, random_pairs(40, 0), seq_len=seq_len, eval_fraction=0.1)
    train, _ = split_encoded(encoded, data)
    packed = PreferenceSampler(encoded, train, seq_len, 7, paired=True, packed=True)
    padded = PreferenceSampler(encoded, train, seq_len, 7, paired=True, packed=False)
    pairs = len(train) - 1
    split_tokens = int(encoded.offsets[train[-1]] - encoded.offsets[train[0]])
    assert packed.layout.unit_lengths.sum() == split_tokens  # the held-out pairs counted in no row
    assert packed.real_tokens(0, packed.size) == split_tokens
    # every pair sits whole in exactly one row
    seen = sorted(u for row in range(packed.size) for u in packed.layout.row_units(row).tolist())
    assert seen == list(range(pairs))
    assert packed.size < pairs and packed.efficiency > padded.efficiency

    torch.manual_seed(0)
    model = GPT(vocab_size=256, seq_len=seq_len, d_model=32, n_layer=2, n_head=4).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.2)
        batch = packed.batch(0, 3)  # three packed rows
        units = [u for row in packed.units_of(0, 3) for u in row]
        pair_count = len(units)
        assert batch["desirable"].tolist() == [True] * pair_count + [False] * pair_count
        got = segment_sums(model, batch, packed=True)
        # the same pairs, one padded row per completion (chosen rows first)
        reference = padded.layout.layout([units])
        reference = {name: torch.from_numpy(value) for name, value in reference.items()}
        want = segment_sums(model, reference, packed=False)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    # no segment's tokens in two rows, and each row's segments come in whole pairs
    ids = batch["example_ids"]
    for segment in range(2 * pair_count):
        assert len(set(torch.nonzero(ids == segment)[:, 0].tolist())) == 1
    for row in range(ids.shape[0]):
        present = set(ids[row].tolist()) - {-1}
        assert {s % pair_count for s in present} == {s - pair_count for s in present if s >= pair_count}


def test_kto_units_are_single_examples_with_their_labels(tmp_path):
    rows = [{"prompt": "q", "completion": "good", "label": True}, {"prompt": "q", "completion": "bad", "label": False},
            {"prompt": "x", "chosen": "y", "rejected": "z"}] * 3
    encoded, data = encode(tmp_path, rows, seq_len=32, eval_fraction=0.3)
    train, _ = split_encoded(encoded, data)
    sampler = PreferenceSampler(encoded, train, 32, 1, paired=False, packed=False)
    assert sampler.size == 8  # 6 rows held for training: 4 KTO examples and 2 pairs made 4 examples
    batch = sampler.batch(0, 8)
    labels = [bool(encoded.desirable[e]) for e in range(8)]
    assert sorted(batch["desirable"].tolist()) == sorted(labels) and "margin" not in batch
    assert batch["example_ids"][:, 0].tolist() == list(range(8))


def test_packed_kto_examples_and_pair_margins_follow_their_segments(tmp_path):
    rows = [{"prompt": "q", "completion": "good", "label": True}, {"prompt": "q", "completion": "bad", "label": False}] * 4
    encoded, data = encode(tmp_path, rows, seq_len=32, eval_fraction=0.25)
    train, _ = split_encoded(encoded, data)
    sampler = PreferenceSampler(encoded, train, 32, 3, paired=False, packed=True)
    batch = sampler.batch(0, sampler.size)
    count = len(batch["desirable"])
    assert count == 6 and sorted(batch["example_ids"].unique().tolist()) == list(range(-1, count))
    for segment in range(count):  # "good" completions are the desirable ones
        tokens = batch["input_ids"][batch["example_ids"] == segment]
        assert (b"good" in bytes(tokens.tolist())) == bool(batch["desirable"][segment])
    pairs = [{"prompt": "p", "chosen": "c" * (i + 1), "rejected": "r", "margin": float(i)} for i in range(6)]
    encoded, data = encode(tmp_path / "pairs", pairs, seq_len=32, eval_fraction=0.2)
    train, _ = split_encoded(encoded, data)
    sampler = PreferenceSampler(encoded, train, 32, 3, paired=True, packed=True)
    assert sampler.size == 1  # the 4 training pairs fill one row: a batch of 2 rows holds every pair twice
    batch = sampler.batch(0, 2)
    assert len(batch["margin"]) == 8 and sorted(batch["example_ids"].unique().tolist()) == list(range(-1, 16))
    for pair, margin in enumerate(batch["margin"].tolist()):  # margin i goes with a chosen of i + 1 c's
        chosen = bytes(batch["input_ids"][batch["example_ids"] == pair].tolist())
        assert chosen.count(b"c") == margin + 1


@pytest.mark.parametrize("objective, packing", [("dpo", True), ("dpo", False), ("kto", True)])
def test_build_samplers_gives_preference_batches_for_the_objective(tmp_path, objective, packing):
    from dstrain.data import build_samplers
    data = data_config(tmp_path, random_pairs(20, 1), seq_len=48, packing=packing)
    config = RunConfig.model_validate({"data": data.model_dump(), "train": {"objective": objective}})
    train, held_out = build_samplers(config)
    assert isinstance(train, PreferenceSampler) and train.paired == (objective == "dpo") and train.packed == packing
    assert len(train.lengths) == (19 if objective == "dpo" else 38)  # units: pairs, or KTO examples
    batch = train.batch(0, 2)
    segments = len(batch["desirable"])
    if not packing:
        assert segments == 4 and batch["input_ids"].shape[0] == 4  # 2 pairs: one row per completion
    assert set(batch["example_ids"].unique().tolist()) - {-1} == set(range(segments))


@pytest.mark.parametrize("packing", [False, True])
def test_kto_batches_carry_the_kl_rows_each_prompt_with_the_previous_examples_completion(tmp_path, packing):
    rows = [{"prompt": f"<{i}>", "completion": f"answer {i}", "label": i % 2 == 0} for i in range(10)]
    encoded, data = encode(tmp_path, rows, seq_len=32, eval_fraction=0.1)
    train, _ = split_encoded(encoded, data)
    sampler = PreferenceSampler(encoded, train, 32, 5, paired=False, packed=packing)
    batch = sampler.batch(0, 2)
    count = len(batch["desirable"])
    texts = [bytes(batch["input_ids"][batch["example_ids"] == k].tolist()) for k in range(count)]
    kl = [bytes(batch["kl_input_ids"][batch["kl_example_ids"] == k].tolist()) for k in range(count)]
    for j, other in enumerate([count - 1, *range(count - 1)]):  # TRL's rotation by one within the batch
        prompt, completion = texts[j].split(b">", 1)[0] + b">", b"answer " + texts[other].split(b"answer ")[1]
        assert kl[j] == prompt + completion
    from dstrain.models import preference_loss as pl
    segments = pl.shift_segment_ids(batch["kl_example_ids"], batch["kl_labels"])
    counts = torch.bincount(segments[segments >= 0], minlength=count)
    assert counts.tolist() == [len(t.split(b"answer ")[1]) + len(b"answer ") for t in
                               [texts[o] for o in [count - 1, *range(count - 1)]]]  # the completion and its eos
