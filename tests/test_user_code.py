"""Your own model and data: every data source, the entry points and their errors, and a user model
named as module:function that trains, checkpoints and resumes exactly.

Entry points are imported from the directory dstrain runs in; these tests run in tests/user_code/,
whose usermods.py is written as a user would write it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from dstrain.cli import app
from dstrain.config.schema import RunConfig
from dstrain.data import build_samplers, check_source
from dstrain.data.sampler import WindowSampler, rank_batch
from dstrain.data.sources import ConcatTokens, load_tokens, split
from dstrain.errors import UserError
from dstrain.models import model_builder
from launcher import dstrain

USER_CODE = Path(__file__).parent / "user_code"


def config(**sections) -> RunConfig:
    return RunConfig.model_validate(sections)


def messages(err: pytest.ExceptionInfo) -> str:
    return str(err.value)


@pytest.fixture
def in_user_code(monkeypatch):
    monkeypatch.chdir(USER_CODE)


# ---------------------------------------------------------------------------------------
# Text files and globs

def test_text_globs_join_files_in_sorted_order_byte_level(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"second")
    (tmp_path / "a.txt").write_bytes(b"first")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_bytes(b"third")
    tokens = load_tokens(config(data={"source": "text", "paths": [str(tmp_path / "*.txt"),
                                                                     str(tmp_path / "**" / "c.txt")]}).data)
    assert bytes(tokens) == b"first\nsecond\nthird"


def test_a_pattern_matching_nothing_names_the_key_and_the_pattern(tmp_path):
    with pytest.raises(UserError) as err:
        check_source(config(data={"source": "text", "paths": [str(tmp_path / "*.txt")]}))
    assert "data.paths" in messages(err) and "*.txt" in messages(err)


def test_a_directory_instead_of_files_says_how_to_name_the_files(tmp_path):
    with pytest.raises(UserError) as err:
        check_source(config(data={"source": "text", "paths": [str(tmp_path)]}))
    assert "only directories" in messages(err) and "/*.txt" in messages(err)


def test_too_little_text_for_one_sequence_per_split_is_caught_before_launch(tmp_path):
    (tmp_path / "tiny.txt").write_bytes(b"x" * 100)
    with pytest.raises(UserError) as err:
        check_source(config(data={"source": "text", "paths": [str(tmp_path / "tiny.txt")], "seq_len": 64}))
    assert "held-out split" in messages(err)


def test_a_named_tokenizer_without_transformers_is_a_clear_error(tmp_path, transformers_missing):
    (tmp_path / "a.txt").write_text("hello " * 1000)
    with pytest.raises(UserError) as err:
        check_source(config(data={"source": "text", "paths": [str(tmp_path / "a.txt")], "tokenizer": "gpt2"}))
    assert "pip install transformers" in messages(err) and "data.tokenizer" in messages(err)


def test_a_named_tokenizer_tokenizes_each_file_and_ends_it_with_eos(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 50)
    (tmp_path / "b.txt").write_text("hello world and goodbye world\n" * 50)
    bpe = Tokenizer(models.BPE(unk_token="[UNK]"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    bpe.train([str(tmp_path / "a.txt")], trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]", "<eos>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>", unk_token="[UNK]")
    tokenizer.save_pretrained(tmp_path / "tok")  # a local directory: no download
    tokens = load_tokens(config(data={"source": "text", "paths": [str(tmp_path / "*.txt")],
                                      "tokenizer": str(tmp_path / "tok")}).data)
    eos = tokenizer.eos_token_id
    assert (tokens == eos).sum() == 2 and tokens[-1] == eos
    first = tokens[:list(tokens).index(eos)]
    assert tokenizer.decode(first.tolist()).startswith("the quick brown fox")


# ---------------------------------------------------------------------------------------
# nanoGPT token files

@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_a_token_file_is_memory_mapped_with_its_dtype(tmp_path, dtype):
    values = (np.arange(10_000) * 7 % 70_000).astype(dtype)
    values.tofile(tmp_path / "train.bin")
    tokens = load_tokens(config(data={"source": "tokens", "paths": [str(tmp_path / "train.bin")],
                                      "token_dtype": dtype}).data)
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.dtype(dtype)
    assert np.array_equal(tokens, values)


def test_several_token_files_are_one_stream_that_stays_on_disk(tmp_path):
    np.arange(0, 1000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    np.arange(1000, 1200, dtype=np.uint16).tofile(tmp_path / "val.bin")
    data = config(data={"source": "tokens", "paths": [str(tmp_path / "train.bin"), str(tmp_path / "val.bin")],
                        "seq_len": 16, "eval_fraction": 200 / 1200}).data
    tokens = load_tokens(data)
    assert isinstance(tokens, ConcatTokens) and len(tokens) == 1200
    train, held_out = split(tokens, data.eval_fraction, data.seq_len)
    assert all(isinstance(part, np.memmap) for part in train.parts + held_out.parts)  # slices, not copies
    assert np.array_equal(np.asarray(tokens[990:1010]), np.arange(990, 1010))  # across the file boundary
    assert np.asarray(held_out)[0] == 1000  # nanoGPT's val.bin is the held-out split


def test_a_token_file_that_is_not_whole_tokens_names_the_dtype(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\x00" * 1001)
    with pytest.raises(UserError) as err:
        check_source(config(data={"source": "tokens", "paths": [str(tmp_path / "odd.bin")]}))
    assert "data.token_dtype" in messages(err)


def test_token_ids_beyond_the_gpt_vocabulary_are_a_clear_error(tmp_path):
    np.full(5000, 300, dtype=np.uint16).tofile(tmp_path / "train.bin")
    train, _ = build_samplers(config(data={"source": "tokens", "paths": [str(tmp_path / "train.bin")],
                                           "seq_len": 16}))
    with pytest.raises(UserError) as err:
        train.batch(0, 2)
    assert "model.vocab_size" in messages(err) and "at least 301" in messages(err)


# ---------------------------------------------------------------------------------------
# Order, sharding, resume position, held-out split (no ranks: the sampler is a pure function)

def _stream_sampler(seed=3) -> WindowSampler:
    return WindowSampler(np.arange(10_001, dtype=np.int64), seq_len=10, seed=seed)


def test_batches_depend_only_on_the_sample_index_so_a_resume_continues_exactly():
    used = _stream_sampler()
    for step in range(5):  # a sampler that has already served steps 0..4
        used.batch(step * 8, 8)
    fresh = _stream_sampler()  # a resumed rank starts with a new one
    assert torch.equal(used.batch(40, 8)[0], fresh.batch(40, 8)[0])


def test_ranks_take_disjoint_shares_of_the_same_global_batch_whatever_the_world_size():
    sampler = _stream_sampler()

    def global_batch(step, world, micro, accum):
        rows = [rank_batch(sampler, step, m, r, world, micro, accum)[0] for m in range(accum) for r in range(world)]
        starts = torch.cat(rows)[:, 0].tolist()
        assert len(set(starts)) == len(starts)  # no sample twice in one step
        return sorted(starts)

    # global batch 8: 1 rank x 8, 2 ranks x 4, 4 ranks x 2 micro x 1 accum, 2 ranks x 2 micro x 2 accum
    layouts = [(1, 8, 1), (2, 4, 1), (4, 2, 1), (2, 2, 2)]
    for step in (0, 7, 123):
        assert len({tuple(global_batch(step, *layout)) for layout in layouts}) == 1


def test_epochs_visit_every_window_once_in_a_new_order():
    sampler = _stream_sampler()
    windows = sampler.windows
    first = sampler.batch(0, windows)[0][:, 0].tolist()
    second = sampler.batch(windows, windows)[0][:, 0].tolist()
    assert sorted(first) == sorted(second) == list(range(0, windows * 10, 10))
    assert first != second


def test_the_held_out_split_is_the_tail_and_never_overlaps_training(tmp_path):
    np.arange(5000, dtype=np.uint16).tofile(tmp_path / "t.bin")
    train, held_out = build_samplers(config(data={"source": "tokens", "paths": [str(tmp_path / "t.bin")],
                                                  "seq_len": 16, "eval_fraction": 0.2},
                                            model={"vocab_size": 8192}))
    seen_train = torch.cat([train.batch(0, train.windows)[0], train.batch(0, train.windows)[1]])
    seen_eval = torch.cat([held_out.batch(0, held_out.windows)[0], held_out.batch(0, held_out.windows)[1]])
    assert seen_train.max() < 4000 <= seen_eval.min()


def test_corpus_and_synthetic_sources_are_deterministic():
    for source in ("corpus", "synthetic"):
        a, _ = build_samplers(config(data={"source": source, "seq_len": 32}))
        b, _ = build_samplers(config(data={"source": source, "seq_len": 32}))
        assert torch.equal(a.batch(17, 4)[0], b.batch(17, 4)[0])


# ---------------------------------------------------------------------------------------
# Dataset entry points

def test_a_dataset_entry_point_is_split_sharded_and_collated(in_user_code):
    train, held_out = build_samplers(config(data={"source": "usermods:indexed", "kwargs": {"size": 100},
                                                  "eval_fraction": 0.1}))
    items = train.batch(0, 90)
    assert items.shape == (90,) and sorted(items.tolist()) == list(range(90))  # one epoch: every train item
    assert sorted(held_out.batch(0, 10).tolist()) == list(range(90, 100))
    assert torch.equal(rank_batch(train, 3, 0, 1, 2, 4, 1), train.batch(3 * 8 + 4, 4))  # rank 1's share


def test_a_data_entry_point_that_returns_no_dataset_says_what_it_returned(in_user_code):
    with pytest.raises(UserError) as err:
        build_samplers(config(data={"source": "usermods:not_a_dataset"}))
    assert "list_iterator" in messages(err) and "map-style Dataset" in messages(err)


def test_a_data_entry_point_called_with_wrong_kwargs_names_data_kwargs(in_user_code):
    with pytest.raises(UserError) as err:
        build_samplers(config(data={"source": "usermods:indexed", "kwargs": {"length": 5}}))
    assert "data.kwargs" in messages(err) and "length" in messages(err)


def test_a_forward_that_returns_an_output_object_asks_for_its_loss(in_user_code):
    model = model_builder(config(model={"name": "usermods:returns_outputs"}))()
    with pytest.raises(UserError) as err:
        model((torch.randn(2, 4), torch.randn(2)))
    assert "outputs.loss" in messages(err)


# ---------------------------------------------------------------------------------------
# Bad entry points: exit 2 with a message, already at --dry-run

@pytest.mark.parametrize("name, says", [
    ("no_such_module:build", "cannot import module 'no_such_module'"),
    ("usermods:no_such_function", "has no function 'no_such_function'"),
    ("usermods", "is not an entry point"),
    ("usermods:not_a_module", "returned str, not a torch nn.Module"),
    ("usermods:needs_width", "missing 1 required positional argument: 'width'"),
])
def test_a_bad_model_entry_point_exits_2_at_dry_run(in_user_code, name, says):
    result = CliRunner().invoke(app, ["run", "--dry-run", "--accelerator", "cpu", "--gpus", "2",
                                      "--set", f"model.name={name}"], env={"COLUMNS": "250"})
    assert result.exit_code == 2, result.output
    assert says in result.output and "Traceback" not in result.output


def test_a_bad_data_entry_point_exits_2_at_dry_run(in_user_code):
    result = CliRunner().invoke(app, ["run", "--dry-run", "--accelerator", "cpu", "--gpus", "2",
                                      "--set", "data.source=usermods:nothing_here"], env={"COLUMNS": "250"})
    assert result.exit_code == 2 and "data.source" in result.output


# ---------------------------------------------------------------------------------------
# A user model, end to end through the launcher

def dstrain_in(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return dstrain(*args, cwd=cwd, env={"COLUMNS": "250"})  # in this process, from the user's folder


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


USER_RUN = ["--preset", "stage2", "--accelerator", "cpu", "--gpus", "2", "--set", "model.name=usermods:build",
            "--set", "data.source=usermods:pairs", "--set", "data.kwargs={size: 512}", "--set", "data.seq_len=1",
            "--set", "train.micro_batch_size=8", "--set", "train.schedule=constant", "--set", "train.warmup_steps=1",
            "--set", "train.lr=0.05", "--set", "train.log_every=1", "--set", "train.save_every=3",
            "--set", "train.eval_batches=2", "--set", "train.max_steps=6", "--set", "train.weight_decay=0"]


def metrics(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


@pytest.fixture(scope="module")
def user_model_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("user_model") / "run"
    ok(dstrain_in(USER_CODE, "run", *USER_RUN, "--run-dir", str(run_dir)))
    return run_dir


@pytest.mark.integration
def test_a_user_model_trains_and_saves_complete_checkpoints(user_model_run):
    losses = metrics(user_model_run)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    assert losses[6] < losses[1] / 2  # a linear target: it learns fast
    for tag in ("step00000003", "step00000006"):
        mark = json.loads((user_model_run / "checkpoints" / tag / "dstrain_complete.json").read_text())
        assert mark["world_size"] == 2


@pytest.mark.integration
def test_a_user_model_resumes_exactly_from_a_checkpoint(user_model_run, tmp_path):
    resumed_dir = tmp_path / "resumed"
    result = ok(dstrain_in(USER_CODE, "run", *USER_RUN, "--run-dir", str(resumed_dir),
                           "--resume", str(user_model_run / "checkpoints" / "step00000003")))
    assert "resumed from step00000003 at step 3" in result.stdout
    straight, resumed = metrics(user_model_run), metrics(resumed_dir)
    assert sorted(resumed) == [4, 5, 6]
    for step in resumed:
        assert resumed[step] == pytest.approx(straight[step], rel=1e-5), (step, resumed, straight)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_stage_0_to_2_models_are_built_on_the_training_device(stage):
    # The meta device stands in for a GPU: every parameter must be created where the model trains,
    # never first on the host (a 7B model would be initialised by the host's RNG and held in RAM).
    from dstrain.models import build_model
    model = build_model(config(model={"n_layer": 1, "d_model": 32, "n_head": 2}),
                        {"zero_optimization": {"stage": stage}}, torch.device("meta"))
    assert {p.device.type for p in model.parameters()} == {"meta"}
