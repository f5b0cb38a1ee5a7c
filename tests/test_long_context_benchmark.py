"""benchmarks/long_context.py's pure parts for its peers' rows (TRL and a plain Accelerate loop): the configs
it hands `accelerate launch`, its argument parsing, its tokens/s arithmetic and its table rows. No launcher:
seconds."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
peers = pytest.importorskip("long_context")


def test_deepspeed_config_is_zero3_micro_batch_one():
    config = peers.deepspeed_config("cuda")
    assert config["zero_optimization"]["stage"] == 3
    assert config["train_micro_batch_size_per_gpu"] == 1 and config["gradient_accumulation_steps"] == 1
    assert config["bf16"] == {"enabled": True} and config["train_batch_size"] == "auto"
    assert peers.deepspeed_config("cpu", 2)["bf16"] == {"enabled": False}
    assert peers.deepspeed_config("cpu", 2)["train_batch_size"] == 2


def test_accelerate_config_splits_the_sequence_only_for_sp():
    sp = peers.accelerate_config(4, 4, "/x/ds.json", "cuda", "sdpa")
    assert sp["distributed_type"] == "DEEPSPEED" and sp["num_processes"] == 4
    assert sp["deepspeed_config"]["deepspeed_config_file"] == "/x/ds.json"
    # accelerate refuses these beside a deepspeed_config_file
    assert "mixed_precision" not in sp and "zero_stage" not in sp["deepspeed_config"]
    parallel = sp["parallelism_config"]
    assert parallel["parallelism_config_sp_backend"] == "deepspeed" and parallel["parallelism_config_sp_size"] == 4
    assert parallel["parallelism_config_dp_shard_size"] * parallel["parallelism_config_sp_size"] == 4
    assert "parallelism_config" not in peers.accelerate_config(2, 1, "/x/ds.json", "cuda", "sdpa")
    assert peers.accelerate_config(2, 2, "/x/ds.json", "cpu", "sdpa")["use_cpu"] is True


def test_parallelism_config_accepts_what_the_script_writes():
    pytest.importorskip("accelerate")
    from accelerate.utils import ParallelismConfig
    from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig
    config = ParallelismConfig(sp_backend="deepspeed", sp_size=2, dp_shard_size=1,
                               sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length=64, sp_attn_implementation="sdpa"))
    assert config.sp_enabled and config.total_size == 2


def test_arguments_and_layouts():
    args = peers.parse(["--gpus", "1,2,4", "--seq-lens", "32768"])
    assert peers.layouts(args) == [(1, 1), (2, 1), (2, 2), (4, 1), (4, 4)]  # dp and sp by default
    assert peers.layouts(peers.parse(["--gpus", "2,4", "--layouts", "sp"])) == [(2, 2), (4, 4)]
    assert args.runners == "dstrain" and args.worker is None
    with pytest.raises(SystemExit):
        peers.parse(["--runners", "lightning"])
    with pytest.raises(SystemExit):
        peers.parse(["--variants", "huge"])


def test_tokens_per_s_counts_the_whole_job_after_warmup():
    stamps = [0.0, 10.0, 11.0, 12.0, 13.0, 14.0]  # 5 steps; the first is slow (warm-up)
    assert peers.tokens_per_s(stamps, 1000, 1, warmup=1, every=2) == [1000.0, 1000.0]
    assert peers.tokens_per_s(stamps, 1000, 2, warmup=1, every=1) == [2000.0] * 4  # two sequences a step (DP 2)


def test_mfu_uses_dstrains_formula(tmp_path):
    pytest.importorskip("transformers")
    peers.make_tiny(tmp_path)
    per_token = peers.model_flops_per_token(tmp_path, 64)
    assert per_token > 12 * 4 * 64 * 64  # the attention term alone
    row = {"gpus": 2, "tokens_per_s": 1e6}
    peers.add_mfu(row, per_token, "NVIDIA H100 80GB HBM3")
    assert row["tflops_per_device"] == pytest.approx(1e6 * per_token / 2 / 1e12)
    assert row["mfu"] == pytest.approx(row["tflops_per_device"] / 989.0)


def test_rows_print_figures_or_the_reason():
    ok = {"runner": "trl", "gpus": 2, "sequence_parallel": 2, "seq_len": 32768, "status": "ok",
          "tokens_per_s": 12345.6, "mfu": 0.41, "peak_memory_gib": 30.25}
    line = peers.describe(ok)
    assert "SP 2" in line and "trl" in line and "32,768" in line and "12,346" in line and "41.0%" in line
    missing = dict(ok, status="unavailable", reason="trl is not installed", tokens_per_s=None, mfu=None)
    assert peers.describe(missing).endswith("unavailable  trl is not installed")
    assert "max 65,536" in peers.describe(dict(ok, search="max", max_seq_len=65536))


def test_last_error_skips_the_launchers_own_lines():
    output = "[rank1]: ValueError: bad\ntorch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
    assert peers.last_error(output) == "[rank1]: ValueError: bad"
