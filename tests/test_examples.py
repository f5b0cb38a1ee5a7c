"""examples/: each example's config is valid, and each one trains on CPU at a tiny size.

Entry points in the examples are named from the repository root (examples.bert_mlm.bert:build),
so the launches run there, as the examples' own comments tell users to.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from dstrain.cli import app
from dstrain.config.resolve import resolve
from dstrain.launcher.topology import read_hostfile
from launcher import dstrain

REPO = Path(__file__).parent.parent
EXAMPLES = REPO / "examples"


@pytest.fixture
def at_repo_root(monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.syspath_prepend(str(REPO))


def test_default_yaml_is_exactly_the_default_job():
    written_out = resolve(None, EXAMPLES / "default.yaml", [], world_size=2, accelerator="cpu")
    default_job = resolve("stage2_offload", None, [], world_size=2, accelerator="cpu")  # README's command
    assert written_out.config == default_job.config
    assert written_out.ds_config == default_job.ds_config


@pytest.mark.parametrize("example", ["bert_mlm", "regression"])
def test_example_config_passes_every_check_at_dry_run(at_repo_root, example):
    result = CliRunner().invoke(app, ["run", "--config", str(EXAMPLES / example / "config.yaml"), "--dry-run",
                                      "--accelerator", "cpu", "--gpus", "2"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert f"model: examples.{example}." in result.output


def test_huggingface_example_without_transformers_says_what_to_install(at_repo_root, transformers_missing):
    result = CliRunner().invoke(app, ["run", "--config", str(EXAMPLES / "huggingface" / "config.yaml"), "--dry-run",
                                      "--accelerator", "cpu"], env={"COLUMNS": "250"})
    assert result.exit_code == 2
    assert "pip install transformers" in result.output and "Traceback" not in result.output


def test_preference_example_resolves_to_lora_dpo_and_its_pairs_load(at_repo_root, tmp_path):
    """examples/preference/dpo_lora.yaml: DPO with the adapters switched off as the reference; its pairs.jsonl
    read and laid out in batches (byte tokens here: the example's own tokenizer is made by a script)."""
    from dstrain.data import build_samplers
    resolved = resolve(None, EXAMPLES / "preference" / "dpo_lora.yaml", [], world_size=2, accelerator="cpu", env={})
    config = resolved.config
    assert (config.train.objective, config.preference.reference, resolved.warnings) == ("dpo", "adapters_off", [])
    assert config.model.lora is not None and config.data.format == "preference"
    bytes_ = resolve(None, EXAMPLES / "preference" / "dpo_lora.yaml",
                     ["data.tokenizer=byte", f"data.cache_dir={tmp_path}", "data.packing=true"], world_size=2,
                     accelerator="cpu", env={})
    train, held_out = build_samplers(bytes_.config)
    batch = train.batch(0, config.train.micro_batch_size)
    assert {"input_ids", "labels", "example_ids", "margin"} <= set(batch) and held_out.size >= 1


def test_multinode_hostfile_is_a_valid_deepspeed_hostfile():
    assert read_hostfile(EXAMPLES / "multinode" / "hostfile") == {"worker-0": 8, "worker-1": 8}


def test_bert_masking_follows_berts_rule_and_is_fixed_per_item(at_repo_root):
    from examples.bert_mlm.bert import CLS_ID, IGNORE, MASK_ID
    from examples.bert_mlm.data import masked_bytes

    dataset = masked_bytes(seq_len=128)
    items = [dataset[i] for i in range(400)]
    ids = torch.stack([item["input_ids"] for item in items])
    labels = torch.stack([item["labels"] for item in items])
    assert (ids[:, 0] == CLS_ID).all() and (labels[:, 0] == IGNORE).all()
    chosen = labels != IGNORE
    assert 0.13 < chosen.float().mean() < 0.17  # 15% of positions are predicted
    masked = (ids[chosen] == MASK_ID).float().mean()
    kept = (ids[chosen] == labels[chosen]).float().mean()
    assert 0.77 < masked < 0.83 and 0.08 < kept < 0.12  # 80% [MASK], 10% kept (and 10% random)
    assert (ids[~chosen] == torch.stack([dataset[i]["input_ids"] for i in range(400)])[~chosen]).all()
    assert all(torch.equal(dataset[i]["input_ids"], items[i]["input_ids"]) for i in (0, 17, 399))


# ---------------------------------------------------------------------------------------
# Each example trains, tiny, through the real launcher

def train(example: str, run_dir: Path, *sets: str, env: dict | None = None, gpus: int = 2) -> dict[int, float]:
    """Train `example` tiny; the examples whose point is not several ranks run on one rank accumulating two
    micro batches (the same global batches: a rank process less, about 6 s of CPU in CI)."""
    if gpus == 1:
        sets = ("train.grad_accum_steps=2", *sets)
    args = ["run", "--config", str(EXAMPLES / example), "--accelerator", "cpu", "--gpus", str(gpus), "--run-dir", str(run_dir)]
    for item in ("train.log_every=1", "train.eval_batches=2", *sets):
        args += ["--set", item]
    result = dstrain(*args, cwd=REPO, env={"COLUMNS": "250", **(env or {})})  # in this process, from the checkout
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return trained(run_dir)


def trained(run_dir: Path) -> dict[int, float]:
    """step -> loss of a run that ended as every example's should: evaluated, with a checkpoint."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("eval_loss" in row for row in rows)
    assert (run_dir / "checkpoints" / "latest").is_file()
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


@pytest.mark.integration
def test_default_example_trains(default_job):
    """conftest's default_job: examples/default.yaml at the tiny size, 30 steps logged every 5 (test_run reads
    the same run for the README's command, which default.yaml writes out)."""
    run_dir, result = default_job
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert sorted(trained(run_dir)) == [5, 10, 15, 20, 25, 30]


@pytest.mark.integration
def test_bert_mlm_example_learns_to_fill_in_masked_bytes(tmp_path):
    losses = train("bert_mlm/config.yaml", tmp_path / "run", "train.max_steps=16", "model.kwargs.d_model=32",
                   "model.kwargs.n_layer=2", "model.kwargs.n_head=2", "model.kwargs.d_ff=64", "data.seq_len=32",
                   "data.kwargs.seq_len=32", "train.micro_batch_size=8", "train.warmup_steps=2", "train.lr=3e-3", gpus=1)
    assert losses[1] == pytest.approx(torch.log(torch.tensor(258.0)).item(), abs=0.3)  # uniform over the vocab
    assert losses[16] < losses[1] - 0.5


@pytest.mark.integration
def test_regression_example_with_a_user_model_and_dataset_learns(tmp_path):
    losses = train("regression/config.yaml", tmp_path / "run", "train.max_steps=40", "train.warmup_steps=1",
                   "train.schedule=constant", "train.lr=1e-2", "model.kwargs.hidden=32", gpus=1)
    assert min(losses[step] for step in range(36, 41)) < losses[1] * 0.6


@pytest.mark.integration
def test_huggingface_example_trains_through_the_adapter(tmp_path):
    losses = train("huggingface/config.yaml", tmp_path / "run", "train.max_steps=6", "model.kwargs.n_layer=1",
                   "model.kwargs.n_embd=32", "model.kwargs.n_head=2", "model.kwargs.n_positions=32", "data.seq_len=32",
                   "train.micro_batch_size=4", gpus=1)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]


@pytest.mark.integration
def test_finetune_llama_example_trains_on_its_instructions_and_exports_a_folder_transformers_loads(tmp_path):
    """The example as its comments run it: a tiny Llama and its BPE tokenizer saved locally, ZeRO-3
    prompt/response fine-tuning on the shipped JSONL, `export_final: hf` in bf16 with the tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = tmp_path / "tiny-llama"
    made = subprocess.run([sys.executable, str(EXAMPLES / "finetune_llama" / "make_tiny_llama.py"), str(model_dir),
                           "--layers", "2", "--width", "64", "--vocab", "512"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-3000:]
    run_dir = tmp_path / "run"
    losses = train("finetune_llama/config.yaml", run_dir, f"model.name=hf:{model_dir}", "train.max_steps=6",
                   "train.eval_every=3", "train.save_every=6", "train.lr=3e-3", "train.warmup_steps=1",
                   "data.seq_len=64")
    assert sorted(losses) == [1, 2, 3, 4, 5, 6] and losses[6] < losses[1]

    exported = run_dir / "final_hf"
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (exported / name).is_file(), name
    model, info = AutoModelForCausalLM.from_pretrained(exported, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.config.architectures == ["LlamaForCausalLM"] and model.dtype == torch.bfloat16
    source, exported_tokenizer = AutoTokenizer.from_pretrained(model_dir), AutoTokenizer.from_pretrained(exported)
    prompt = "What is the capital of France?\n"
    assert exported_tokenizer(prompt)["input_ids"] == source(prompt)["input_ids"]
    # Trained: the exported weights moved away from the ones the run started from.
    original = AutoModelForCausalLM.from_pretrained(model_dir)
    weights = {k: v.float() for k, v in model.state_dict().items()}
    assert set(weights) == set(original.state_dict())
    changed = [k for k, v in original.state_dict().items() if not torch.allclose(v, weights[k], atol=1e-2)]
    assert changed, "no exported weight differs from the starting model"
