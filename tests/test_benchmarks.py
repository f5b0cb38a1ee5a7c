"""The GPU benchmark scripts still run: their CPU smoke paths, through the real launcher, write
results files of the promised shape (the GPU figures themselves are in benchmarks/results/)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.integration

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
TINY = ["--accelerator", "cpu", "--d-model", "64", "--n-head", "2", "--vocab-size", "256", "--seq-len", "32"]


def run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, str(BENCHMARKS / name), *args], capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_suite_trains_an_hf_shape_three_ways_with_a_variant_and_bounds_the_offload_row(tmp_path):
    """One suite call, every runner CPU ranks have: --hf-shape builds the folder once; torch (as it is and in
    an accumulating variant), DeepSpeed's own loop and dstrain train it from the same weights on the same
    batches; the results file has the promised shape; the offload rows carry their fraction of the host's
    bound. (One call since 2026-11-29: the built-in GPT's three-runner call and this one started 6 rows and
    2 suites for these facts; the GPT's model facts are checked in-process below. The torch runner's
    +compile_blocks calls dstrain's compile_hf_blocks, whose loss and gradients equal eager's in
    test_hf_compile.py; compiling it here cost minutes of C++ builds on 2 cores for the same fact.)"""
    run_script("suite.py", "--accelerator", "cpu", "--hf-shape", "tiny-qwen2", "--hf-dir", str(tmp_path / "hf"),
               "--seq-len", "32", "--micro-batch", "2", "--steps", "6", "--log-every", "2", "--warmup", "2",
               "--runners", "torch,deepspeed,dstrain", "--presets", "stage2_offload",
               "--variant", "a2@torch=train.grad_accum_steps=2", "--bound-elements", "1000000",
               "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"))
    [path] = (tmp_path / "out").glob("*-cpu.json")
    doc = json.loads(path.read_text())
    assert {"device", "versions", "model", "rows"} <= set(doc)
    assert doc["model"]["params"] > 0 and doc["model"]["flops_per_token"] > 0
    assert doc["model"]["architecture"] == "Qwen2ForCausalLM" and doc["model"]["name"].startswith("hf:")
    assert (tmp_path / "hf" / "tiny-qwen2" / "config.json").exists()
    assert doc["offload_rates"]["adam_gb_s"] > 0 and doc["offload_rates"]["h2d_gb_s"] is None  # no GPU here
    rows = {(row["runner"], row["variant"]): row for row in doc["rows"]}
    assert set(rows) == {("torch", ""), ("torch", "a2"), ("deepspeed", ""), ("dstrain", "")}
    torch_row = rows[("torch", "")]
    assert torch_row["preset"] == "none" and rows[("dstrain", "")]["preset"] == "stage2_offload"
    for row in rows.values():
        assert row["status"] == "ok", row
        assert row["gpus"] == 1 and row["tokens_per_s"] > 0 and row["first_step_s"] > 0
        assert {"tflops_per_gpu", "peak_gpu_gib", "host_rss_gib"} <= set(row)
        # same batches, same initial weights: the first logged losses agree across runners
        assert row["loss_curve"][0][1] == pytest.approx(torch_row["loss_curve"][0][1], rel=0.02)
    assert rows[("dstrain", "")]["ds_config_matches_rendered"] is True
    assert rows[("dstrain", "")]["vs_deepspeed"] > 0
    # torch accumulating the same micro batch twice takes the same update: the same losses, twice the tokens
    assert rows[("torch", "a2")]["grad_accum"] == 2
    assert [loss for _, loss in rows[("torch", "a2")]["loss_curve"]] == pytest.approx(
        [loss for _, loss in torch_row["loss_curve"]], rel=1e-5)
    for runner in ("deepspeed", "dstrain"):
        bound = rows[(runner, "")]["offload_bound"]
        assert bound["adam_s"] > 0 and bound["gpu_s"] > 0  # the torch row's step time is the GPU's part
        assert bound["fraction"] == pytest.approx(bound["bound_s"] / (rows[(runner, "")]["step_ms"] / 1000), rel=0.01)


@pytest.mark.parametrize("preset", ["none", "stage2", "stage3_nvme"])
def test_suite_settings_for_the_built_in_gpt_resolve_and_count_its_parameters(preset, tmp_path):
    """The suite's built-in GPT (the README's peer rows, trained on GPUs; the rows on CPU ranks are the hf:
    call's above): each row's dstrain settings resolve as `dstrain run` resolves them, and the model's
    parameters and FLOPs a token are counted from the model those settings build."""
    sys.path.insert(0, str(BENCHMARKS))
    import suite
    from dstrain.config.resolve import resolve
    from dstrain.models import model_builder
    args = SimpleNamespace(hf=None, hf_shape=None, n_layer=2, d_model=64, n_head=2, vocab_size=256, seq_len=32,
                           micro_batch=2, steps=6, log_every=2, warmup=2, set=None, nvme_path=str(tmp_path))
    config = resolve(preset if preset != "none" else None, None, suite._shape_sets(args, preset, 1), world_size=1,
                     accelerator="cpu", env={}).config
    assert (config.model.n_layer, config.model.d_model, config.data.seq_len) == (2, 64, 32)
    model = suite._model_info(args)
    built = model_builder(config)()
    assert model["name"] == "gpt" and model["params"] == sum(p.numel() for p in built.parameters())
    assert model["flops_per_token"] > 6 * model["params"]  # plus attention


def test_largest_model_search_trains_the_predicted_depth(tmp_path):
    run_script("largest_model.py", *TINY, "--presets", "stage1", "--max-layers", "2", "--max-trials", "2",
               "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"),
               "--nvme-path", str(tmp_path / "nvme"))
    [path] = (tmp_path / "out").glob("*-largest.json")
    doc = json.loads(path.read_text())
    entry = doc["presets"]["stage1"]
    assert entry["status"] == "done"
    assert entry["predicted_n_layer"] == 2  # a 2-layer toy fits this machine by far
    assert entry["trials"][0]["outcome"] == "ok"
    assert entry["largest_trained"]["n_layer"] == 2
    assert doc["host_ram_gib"] > 0 and doc["family"]["d_model"] == 64


def test_instruction_data_follows_alpaca_gpt4_lengths_and_the_seed(tmp_path):
    sys.path.insert(0, str(BENCHMARKS))
    from make_instruction_data import write
    first = write(tmp_path / "a", examples=2000, seed=3, chars_per_token=4.0)
    write(tmp_path / "b", examples=2000, seed=3, chars_per_token=4.0)
    for layout in ("alpaca.jsonl", "sharegpt.jsonl"):
        assert (tmp_path / "a" / layout).read_bytes() == (tmp_path / "b" / layout).read_bytes()
    # the published means (Wang et al. 2023, Table 1): prompt 28.0, completion 161.8 LLaMA tokens
    assert first["mean_prompt_tokens"] == pytest.approx(28.0, rel=0.1)
    assert first["mean_tokens"]["output"] == pytest.approx(161.8, rel=0.1)
    alpaca = [json.loads(line) for line in (tmp_path / "a" / "alpaca.jsonl").read_text().splitlines()]
    sharegpt = [json.loads(line) for line in (tmp_path / "a" / "sharegpt.jsonl").read_text().splitlines()]
    assert len(alpaca) == len(sharegpt) == 2000
    assert sharegpt[0]["conversations"][1] == {"from": "gpt", "value": alpaca[0]["output"]}
    # characters follow the sampled tokens: ~4 characters a token of output on average
    mean_chars = sum(len(row["output"]) for row in alpaca) / len(alpaca)
    assert mean_chars == pytest.approx(4.0 * first["mean_tokens"]["output"], rel=0.1)


def test_sft_benchmark_runs_a_padded_dstrain_row_and_reports_real_tokens(tmp_path):
    run_script("sft.py", "--tiny", "--rows", "dstrain-z2-full-padded", "--steps", "2", "--examples", "60",
               "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out"))
    doc = json.loads((tmp_path / "out" / "sft-cpu.json").read_text())
    assert doc["model"]["shape"]["vocab_size"] == 512 and doc["data"]["examples"] == 60
    [row] = doc["rows"]
    assert row["name"] == "dstrain-z2-full-padded" and "error" not in row, row
    # padding counts in row tokens/s, never in real tokens/s
    assert 0 < row["real_tokens_per_s"] < row["row_tokens_per_s"]
    assert row["first_loss"] > 0 and row["last_loss"] > 0
    assert (tmp_path / "out" / "logs" / "dstrain-z2-full-padded.log").exists()


def test_rows_picks_a_whole_name_alone_and_a_bare_word_inside_names():
    """--rows of sft.py, preference.py and fp8.py: `fp8-tensorwise` is that row, not also fp8-tensorwise-exact
    (2026-11-29's loss check ran a row it was not asked for); a word or a glob picks every row it matches."""
    sys.path.insert(0, str(BENCHMARKS))
    from run_record import pick
    rows = [{"name": name} for name in ("bf16", "fp8-tensorwise", "fp8-rowwise", "fp8-tensorwise-exact")]
    assert [r["name"] for r in pick(rows, "bf16,fp8-tensorwise")] == ["bf16", "fp8-tensorwise"]
    assert [r["name"] for r in pick(rows, "tensorwise")] == ["fp8-tensorwise", "fp8-tensorwise-exact"]
    assert [r["name"] for r in pick(rows, "fp8-*")] == ["fp8-tensorwise", "fp8-rowwise", "fp8-tensorwise-exact"]
    assert pick(rows, None) == rows
