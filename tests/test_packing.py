"""data.packing: several whole examples per row, kept apart by their position ids.

The defining property: the summed loss of a packed row equals the sum of its examples' losses, each
computed alone in a row of its own (fp32, CPU), through dstrain's own model wrappers, for tiny
Llama-, Qwen2- and GPT-2-style Hugging Face models (eager and sdpa attention) and the built-in GPT.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dstrain.config.schema import RunConfig
from dstrain.models.packing import decide_packing as packing
from dstrain.data.binpack import pack_rows
from dstrain.data.sampler import ExampleSampler, PackedExampleSampler, rank_batch
from dstrain.errors import UserError

IGNORE = -100
SEQ = 48


def examples(count: int = 23, seed: int = 0, vocab: int = 256):
    """Flat ids/labels/offsets of `count` examples of 3..40 tokens: a masked prompt, then labels."""
    rng = np.random.default_rng(seed)
    ids, labels, offsets = [], [], [0]
    for _ in range(count):
        length = int(rng.integers(3, 41))
        prompt = int(rng.integers(1, length))
        tokens = rng.integers(3, vocab, size=length)
        ids += tokens.tolist()
        labels += [IGNORE] * prompt + tokens[prompt:].tolist()
        offsets.append(len(ids))
    return np.asarray(ids), np.asarray(labels), np.asarray(offsets)


def tiny_hf(family: str, attention: str):
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config
    torch.manual_seed(0)
    common = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config = {"llama": lambda: LlamaConfig(**common, tie_word_embeddings=False),
              "qwen2": lambda: Qwen2Config(**common, tie_word_embeddings=True),
              "gpt2": lambda: GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=256, n_positions=64,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)}[family]()
    from dstrain.models.hf import CausalLM
    return CausalLM(AutoModelForCausalLM.from_config(config, attn_implementation=attention, dtype=torch.float32))


def summed_loss(model, batch) -> torch.Tensor:
    """The batch's loss summed over its predicted labels (the model returns their mean)."""
    count = int((batch["labels"][:, 1:] != IGNORE).sum())
    return model(batch) * count


@pytest.mark.parametrize("family,attention", [("llama", "sdpa"), ("llama", "eager"), ("qwen2", "sdpa"),
                                              ("qwen2", "eager"), ("gpt2", "sdpa"), ("gpt2", "eager"),
                                              ("gpt", "builtin")])
def test_a_packed_rows_loss_is_the_sum_of_its_examples_losses(family, attention):
    ids, labels, offsets = examples()
    if family == "gpt":
        from dstrain.models.gpt import GPT
        torch.manual_seed(0)
        model = GPT(256, SEQ, 32, 2, 4)
    else:
        model = tiny_hf(family, attention)
    model.eval()
    packed = PackedExampleSampler(ids, labels, offsets, SEQ, pad_id=0, seed=7)
    assert packed.size < len(offsets) - 1  # several examples share a row
    with torch.no_grad():
        rows = packed.batch(0, packed.size)  # every row, in one batch
        alone = sum(summed_loss(model, {"input_ids": torch.as_tensor(ids[a:b])[None],
                                        "labels": torch.as_tensor(labels[a:b])[None]})
                    for a, b in zip(offsets[:-1], offsets[1:]))
        together = summed_loss(model, rows)
    assert float(together) == pytest.approx(float(alone), rel=1e-5)


def test_packed_labels_are_the_examples_labels_with_each_first_one_masked():
    ids, labels, offsets = examples(count=9)
    sampler = PackedExampleSampler(ids, labels, offsets, SEQ, pad_id=1, seed=3)
    seen = []
    for row in range(sampler.size):
        sample = next(s for s in range(sampler.size) if sampler.order.item(s) == row)
        batch = {k: v[0].tolist() for k, v in sampler.batch(sample, 1).items()}
        at = 0
        for item in sampler.row_examples(row):
            a, b = int(offsets[item]), int(offsets[item + 1])
            assert batch["input_ids"][at:at + b - a] == ids[a:b].tolist()
            assert batch["labels"][at:at + b - a] == [IGNORE] + labels[a + 1:b].tolist()
            assert batch["position_ids"][at:at + b - a] == list(range(b - a))
            at += b - a
            seen.append(int(item))
        assert batch["input_ids"][at:] == [1] * (SEQ - at)  # padding: pad_id, no label
        assert batch["labels"][at:] == [IGNORE] * (SEQ - at)
    assert sorted(seen) == list(range(len(offsets) - 1))  # every example whole, exactly once


def test_first_fit_decreasing_fills_rows_and_never_overflows_them():
    lengths = np.random.default_rng(0).integers(20, 400, size=5000)
    items, row_offsets = pack_rows(lengths, 1024, seed=1)
    per_row = np.add.reduceat(lengths[items], row_offsets[:-1])
    assert sorted(items.tolist()) == list(range(5000)) and per_row.max() <= 1024
    assert per_row.sum() / (len(per_row) * 1024) > 0.97  # vs. about 0.2 with one example per row


def test_the_packed_order_is_a_function_of_seed_and_sample_on_any_number_of_ranks():
    ids, labels, offsets = examples(count=60)
    sampler = PackedExampleSampler(ids, labels, offsets, SEQ, pad_id=0, seed=5)
    resumed = PackedExampleSampler(ids, labels, offsets, SEQ, pad_id=0, seed=5)  # a fresh process, same seed
    micro, accum = 2, 2
    for step in (0, 3, 11):  # 11: past the first epoch
        whole = sampler.batch(step * micro * accum * 2, micro * accum * 2)
        for world in (1, 2, 4):
            per_rank = [rank_batch(resumed, step, m, r, world, micro * 2 // world, accum)
                        for m in range(accum) for r in range(world)]
            for key in whole:
                assert torch.equal(torch.cat([b[key] for b in per_rank]), whole[key])
    assert not torch.equal(sampler.batch(0, 4)["input_ids"],
                           PackedExampleSampler(ids, labels, offsets, SEQ, 0, seed=6).batch(0, 4)["input_ids"])


def test_real_tokens_count_the_examples_not_the_padding():
    ids, labels, offsets = examples(count=30)
    for cls in (PackedExampleSampler, ExampleSampler):
        sampler = cls(ids, labels, offsets, SEQ, pad_id=0, seed=2)
        everything = sampler.real_tokens(0, sampler.size)
        assert everything == len(ids)  # one pass holds every example once
        assert sampler.efficiency == pytest.approx(len(ids) / (sampler.size * SEQ))


def hf_config_of(model_type: str, **kwargs):
    from transformers import AutoConfig
    return AutoConfig.for_model(model_type, **kwargs)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gpt2", "mistral", "gemma2"])
@pytest.mark.parametrize("attention", [None, "sdpa", "eager", "flash_attention_2"])
def test_models_that_build_their_mask_from_position_ids_can_pack(model_type, attention):
    from dstrain.models.packing import hf_packing_problem
    assert hf_packing_problem(hf_config_of(model_type), attention) is None


def test_models_that_cannot_keep_examples_apart_say_why():
    from dstrain.models.packing import hf_packing_problem
    assert "attn_implementation" in hf_packing_problem(hf_config_of("llama"), "paged|sdpa")
    assert "position ids" in hf_packing_problem(hf_config_of("mamba"), None)  # no attention mask at all
    remote = hf_config_of("llama")
    remote.auto_map = {"AutoModelForCausalLM": "modeling_x.X"}
    assert "trust_remote_code" in hf_packing_problem(remote, None)


def run_config(model: str, packing_value, **model_keys) -> RunConfig:
    return RunConfig.model_validate({"model": {"name": model, **model_keys},
                                     "data": {"source": "jsonl", "format": "prompt_response", "packing": packing_value}})


def test_packing_auto_pads_with_a_note_and_true_refuses_a_model_that_cannot(tmp_path):
    from transformers import MambaConfig
    MambaConfig(vocab_size=256, hidden_size=16, num_hidden_layers=1).save_pretrained(tmp_path)
    on, note = packing(run_config(f"hf:{tmp_path}", "auto"))
    assert not on and "padded" in note and "position ids" in note
    with pytest.raises(UserError) as err:
        packing(run_config(f"hf:{tmp_path}", True))
    assert "data.packing" in str(err.value) and "auto" in str(err.value)
    assert packing(run_config("gpt", "auto")) == (True, None)
    assert packing(run_config("gpt", False)) == (False, None)
    text = RunConfig.model_validate({"data": {"source": "jsonl", "format": "text", "packing": True}})
    assert packing(text) == (False, None)  # token streams are windows already


def test_packed_rows_on_gpus_get_flex_attention_where_the_architecture_has_it_and_the_user_chose_none(tmp_path):
    """hf.auto_attention, as each rank asks it when it builds the model: FlexAttention's block mask skips the
    blocks across a packed row's examples (1.52-1.56x sdpa's masked attention on one H200). Not on CPU ranks
    (no FlexAttention backward there), not for padded rows, not over the user's choice, not for an
    architecture without it (GPT-2 in transformers 5)."""
    from hf_models import save_tiny_gpt2, save_tiny_llama

    from dstrain.models import hf
    llama, gpt2 = save_tiny_llama(tmp_path / "llama"), save_tiny_gpt2(tmp_path / "gpt2")

    def chosen(folder, device, packed=True, **kwargs):
        config = RunConfig.model_validate({"model": {"name": f"hf:{folder}", "kwargs": kwargs},
                                           "data": {"source": "jsonl", "format": "prompt_response", "packing": packed}})
        return hf.auto_attention(config, hf.load_config(config), device)

    assert chosen(llama, "cuda") == "flex_attention"
    assert chosen(llama, torch.device("cuda", 1)) == "flex_attention"
    assert chosen(llama, "cpu") is None
    assert chosen(llama, "cuda", packed=False) is None
    assert chosen(llama, "cuda", attn_implementation="sdpa") is None
    assert chosen(gpt2, "cuda") is None


def test_flex_attention_asked_for_on_cpu_ranks_is_refused_before_they_start_where_torch_cannot_train_it(
        tmp_path, monkeypatch):
    """The installed torch is asked (a 16-token call): torch 2.13's FlexAttention has no backward on CPU, and
    the ranks would otherwise fail after their start-up. Where a torch can, the dry run passes."""
    from typer.testing import CliRunner

    from dstrain.cli import app
    from dstrain.launcher.preflight import _flex_attention_backward_on_cpu
    from hf_models import save_tiny_llama
    llama = save_tiny_llama(tmp_path / "llama")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    args = ["run", "--preset", "stage2", "--dry-run", "--accelerator", "cpu", "--gpus", "2"]
    for item in (f"model.name=hf:{llama}", "model.kwargs={attn_implementation: flex_attention}", "data.seq_len=16",
                 "train.micro_batch_size=2", "data.tokenizer=byte"):
        args += ["--set", item]
    result = CliRunner().invoke(app, args)
    output = " ".join(result.output.split())
    assert "Traceback" not in output
    why = _flex_attention_backward_on_cpu()
    if why is None:
        assert result.exit_code == 0, output
        return
    assert result.exit_code == 2, output
    assert f'model.kwargs.attn_implementation (from --set): flex_attention cannot train on CPU ranks: torch says "{why}"' in output
    assert "use sdpa (or eager) on CPU ranks" in output


# ---------------------------------------------------------------------------------------
# Through the real launcher

WORDS = ("the model reads every example whole and learns the answer after the question while the "
         "padding it no longer needs becomes other examples").split()


def instruction_rows(count: int = 80) -> list[dict]:
    """Prompt/response rows of varied lengths (8 to 120 bytes), as instruction data is."""
    rng = np.random.default_rng(0)
    rows = []
    for i in range(count):
        prompt = " ".join(rng.choice(WORDS, size=int(rng.integers(1, 8))))
        response = " ".join(rng.choice(WORDS, size=int(rng.integers(1, 16))))
        rows.append({"prompt": f"Q{i}: {prompt}?\n", "response": f"{response}."})
    return rows


@pytest.mark.integration
def test_a_packed_hf_run_on_two_ranks_trains_on_packed_rows_reports_real_tokens_and_resumes(tmp_path):
    """Tiny Llama, byte tokens, prompt/response rows, ZeRO-2 on 2 CPU ranks, data.packing left "auto":
    rank 0 reports the packing efficiency; the step-1 loss is transformers' loss on the two ranks'
    packed batches (position ids included) of the initial weights; metrics give real_tokens_per_s
    below tokens_per_s; the loss falls; the evaluation covers the 8 held-out examples once; a resume
    from step 3 repeats steps 4-6 exactly."""
    import json

    from hf_models import save_tiny_llama
    from launcher import assert_ok, dstrain
    from transformers import AutoModelForCausalLM

    from dstrain import rundir
    from dstrain.data import build_samplers
    from dstrain.models.hf import CausalLM

    model_dir = save_tiny_llama(tmp_path / "llama")
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in instruction_rows()))
    run_dir = tmp_path / "run"
    sets = (f"model.name=hf:{model_dir}", "data.source=jsonl", f"data.paths=[{data}]", "data.format=prompt_response",
            "data.tokenizer=byte", f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=160", "data.eval_fraction=0.1",
            "train.micro_batch_size=2", "train.max_steps=6", "train.save_every=3", "train.log_every=1",
            "train.eval_every=6", "train.lr=3e-3", "train.warmup_steps=0", "train.schedule=constant")

    def run(*extra: str):
        args = ["run", "--preset", "stage2", "--accelerator", "cpu", "--gpus", "2", "--run-dir", str(run_dir)]
        for item in sets:
            args += ["--set", item]
        return dstrain(*args, *extra)

    result = run()
    assert_ok(result)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    start = next(r for r in records if r.get("event") == "run_start")
    assert start["packed"] is True and 0.8 < start["packing_efficiency"] <= 1.0
    assert f"packing efficiency {start['packing_efficiency']:.1%}" in result.stdout
    steps = {r["step"]: r for r in records if "loss" in r}
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]
    assert all(np.isfinite(r["loss"]) and 0 < r["real_tokens_per_s"] < r["tokens_per_s"] for r in steps.values())
    assert steps[6]["loss"] < steps[1]["loss"]

    config, _, _ = rundir.read(run_dir)
    assert config.data.packing is True  # "auto" decided before the ranks started, frozen for them
    train, held_out = build_samplers(config)
    evaluation = next(r for r in records if "eval_loss" in r)  # every held-out example once, over both ranks
    assert evaluation["eval_examples"] == 8 and evaluation["eval_samples"] == held_out.size
    assert evaluation["eval_split_samples"] == held_out.size and np.isfinite(evaluation["eval_loss"])
    assert "eval loss" in result.stdout and "8 held-out examples in" in result.stdout
    model = CausalLM(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
    with torch.no_grad():
        expected = [float(model(rank_batch(train, 0, 0, rank, 2, 2, 1))) for rank in (0, 1)]
    assert "position_ids" in rank_batch(train, 0, 0, 0, 2, 2, 1)
    assert steps[1]["loss"] == pytest.approx(sum(expected) / 2, rel=1e-5)

    assert_ok(run("--resume", "step00000003"))
    again = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][len(records):]
    resumed = {r["step"]: r["loss"] for r in again if "loss" in r}
    assert sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(steps[step]["loss"], rel=1e-5), step


EVAL_SCRIPT = """
    import numpy as np
    from dstrain.config.schema import RunConfig
    from dstrain.data.sampler import PackedExampleSampler
    from dstrain.models.gpt import GPT
    from dstrain.rank.evaluation import evaluate
    sys.path.insert(0, "TESTS")
    from test_packing import examples

    ids, labels, offsets = examples(count=31)
    sampler = PackedExampleSampler(ids, labels, offsets, 48, pad_id=0, seed=4)
    torch.manual_seed(0)
    model = GPT(256, 48, 32, 2, 4)
    engine, *_ = deepspeed.initialize(model=model, config={"train_micro_batch_size_per_gpu": 2,
                                                           "gradient_accumulation_steps": 1,
                                                           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})
    out = {"rows": sampler.size, "examples": len(offsets) - 1}
    with torch.no_grad():  # the mean over every held-out label, one row at a time
        sums = [float(model(sampler.batch(i, 1))) * int((sampler.batch(i, 1)["labels"][:, 1:] != -100).sum())
                for i in range(sampler.size)]
        counts = [int((sampler.batch(i, 1)["labels"][:, 1:] != -100).sum()) for i in range(sampler.size)]
    out["expected"] = sum(sums) / sum(counts)
    for batches in (None, 1):
        config = RunConfig.model_validate({"data": {"source": "jsonl", "format": "prompt_response"},
                                           "train": {"micro_batch_size": 2, "global_batch_size": 2,
                                                     "eval_batches": batches}})
        r = evaluate(engine, config, sampler, torch.device("cpu"))
        out[str(batches)] = [r.loss, r.samples, r.examples, r.of_samples]
    result(out)
"""


@pytest.mark.slow
def test_evaluation_covers_every_held_out_row_once_and_weighs_every_label_alike():
    """One real engine: rows that do not fill the last micro batch still count once each, and the eval
    loss is the mean over all held-out labels; train.eval_batches=1 takes the first global batch."""
    from pathlib import Path

    from one_rank import run_one_rank
    out = run_one_rank(EVAL_SCRIPT.replace("TESTS", str(Path(__file__).parent)), timeout=300)
    assert out["rows"] % 2 == 1  # the last micro batch is half empty
    loss, samples, covered, split = out["None"]
    assert (samples, covered, split) == (out["rows"], out["examples"], out["rows"])
    assert loss == pytest.approx(out["expected"], rel=1e-5)
    assert out["1"][1:] == [2, pytest.approx(out["1"][2]), out["rows"]]  # 1 global batch: 2 rows
    assert out["1"][2] < out["examples"]


CHECKPOINTED_SCRIPT = """
    from dstrain.data.sampler import PackedExampleSampler
    from dstrain.models.gpt import GPT
    sys.path.insert(0, "TESTS")
    from test_packing import examples

    ids, labels, offsets = examples(count=12)
    batch = PackedExampleSampler(ids, labels, offsets, 48, pad_id=0, seed=1).batch(0, 3)
    grads = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = GPT(256, 48, 32, 2, 4)
        if checkpointed:
            deepspeed.checkpointing.configure(None)
            model.enable_checkpointing(deepspeed.checkpointing.checkpoint)
        loss = model(batch)
        loss.backward()
        grads.append([float(loss)] + [float(p.grad.abs().sum()) for p in model.parameters()])
    result(grads)
"""


@pytest.mark.slow
def test_the_built_in_gpt_packs_under_deepspeeds_activation_checkpointing():
    """The document mask travels through DeepSpeed's checkpoint with each block: the same loss and
    gradients as without recomputation."""
    from pathlib import Path

    from one_rank import run_one_rank
    plain, checkpointed = run_one_rank(CHECKPOINTED_SCRIPT.replace("TESTS", str(Path(__file__).parent)), timeout=300)
    assert checkpointed == pytest.approx(plain, rel=1e-6)
