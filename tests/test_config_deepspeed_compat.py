"""DeepSpeed JSONs written for other tools work unchanged: a Hugging Face style ZeRO-3 offload config
full of "auto" through PL_DEEPSPEED_CONFIG_PATH, and DeepSpeed's deprecated ZeRO spellings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from dstrain.cli import app
from dstrain.config.layers import ENV_DEEPSPEED_CONFIG
from dstrain.config.resolve import AUTO, resolve

CONFIGS = Path(__file__).parent / "configs"
HF_JSON = CONFIGS / "hf_zero3_offload.json"
LEGACY_JSON = CONFIGS / "legacy_cpu_offload.json"
HF_ENV = {ENV_DEEPSPEED_CONFIG: str(HF_JSON)}


def _leaves(node: Any) -> list[Any]:
    if isinstance(node, dict):
        return [leaf for value in node.values() for leaf in _leaves(value)]
    if isinstance(node, list):
        return [leaf for value in node for leaf in _leaves(value)]
    return [node]


def _zero(ds: dict[str, Any]) -> dict[str, Any]:
    return ds["zero_optimization"]


def test_the_hf_json_fixture_is_full_of_auto():
    assert _leaves(json.loads(HF_JSON.read_text())).count(AUTO) >= 15


def test_hf_json_renders_stage_3_with_params_and_optimizer_offloaded_to_cpu():
    zero = _zero(resolve(world_size=8, env=HF_ENV).ds_config)
    assert zero["stage"] == 3
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert zero["offload_param"] == {"device": "cpu", "pin_memory": True}


def test_hf_json_renders_no_auto_anywhere():
    assert AUTO not in _leaves(resolve(world_size=8, env=HF_ENV).ds_config)


def test_hf_json_batch_arithmetic_holds_for_8_gpus():
    resolved = resolve(sets=["train.micro_batch_size=2", "train.grad_accum_steps=4"], world_size=8, env=HF_ENV)
    ds = resolved.ds_config
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (2, 4)
    assert ds["train_batch_size"] == 2 * 4 * 8


def test_hf_json_optimizer_and_scheduler_autos_come_from_train_settings():
    resolved = resolve(sets=["train.lr=3e-4", "train.warmup_steps=50"], world_size=8, env=HF_ENV)
    ds, train = resolved.ds_config, resolved.config.train
    assert ds["optimizer"] == {"type": "AdamW", "params": {
        "lr": 3e-4, "betas": list(train.betas), "eps": train.eps, "weight_decay": train.weight_decay}}
    assert ds["scheduler"] == {"type": "WarmupLR", "params": {
        "warmup_min_lr": 0.0, "warmup_max_lr": 3e-4, "warmup_num_steps": 50}}
    assert ds["gradient_clipping"] == train.grad_clip


def test_hf_json_precision_auto_is_bf16_on_cuda_and_keeps_the_fp16_options():
    ds = resolve(accelerator="cuda", env=HF_ENV).ds_config
    assert ds["bf16"]["enabled"] is True
    assert ds["fp16"]["enabled"] is False and ds["fp16"]["initial_scale_power"] == 16


def test_hf_json_precision_auto_is_fp32_on_cpu():
    ds = resolve(accelerator="cpu", env=HF_ENV).ds_config
    assert ds.get("bf16", {}).get("enabled", False) is False
    assert ds["fp16"]["enabled"] is False


def test_hf_json_bucket_sizes_are_integers_derived_from_the_model_width():
    zero = _zero(resolve(sets=["model.d_model=512"], env=HF_ENV).ds_config)
    assert zero["reduce_bucket_size"] == 512 * 512
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 512 * 512)
    assert zero["stage3_param_persistence_threshold"] == 10 * 512
    for key in ("sub_group_size", "stage3_max_live_parameters", "stage3_max_reuse_distance"):
        assert zero[key] == 1_000_000_000 and type(zero[key]) is int  # 1e9 in the JSON


def test_hf_json_auto_bucket_sizes_say_where_they_came_from():
    sources = resolve(env=HF_ENV).sources
    assert sources["deepspeed.zero_optimization.reduce_bucket_size"] == "auto: hidden^2 from model.d_model=128"
    assert sources["deepspeed.zero_optimization.sub_group_size"] == f"{ENV_DEEPSPEED_CONFIG} ({HF_JSON})"


def test_hf_json_through_the_cli_prints_a_consistent_explicit_json():
    result = CliRunner().invoke(app, ["config", "--gpus", "8", "--accelerator", "cuda", "--deepspeed-json"],
                                env=HF_ENV)
    assert result.exit_code == 0, result.output
    ds = json.loads(result.stdout)
    assert _zero(ds)["stage"] == 3 and _zero(ds)["offload_optimizer"]["device"] == "cpu"
    assert AUTO not in _leaves(ds)
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 8


def test_deprecated_cpu_offload_becomes_offload_optimizer_on_cpu_with_a_warning():
    resolved = resolve(env={ENV_DEEPSPEED_CONFIG: str(LEGACY_JSON)})
    zero = _zero(resolved.ds_config)
    assert zero["offload_optimizer"] == {"device": "cpu"}
    assert "cpu_offload" not in zero
    assert any("cpu_offload is deprecated" in w and "offload_optimizer" in w for w in resolved.warnings)


def test_deprecated_cpu_offload_false_adds_no_offload():
    zero = _zero(resolve(sets=["deepspeed.zero_optimization={stage: 2, cpu_offload: false}"], env={}).ds_config)
    assert zero == {"stage": 2}


def test_deprecated_cpu_offload_param_becomes_offload_param_on_cpu():
    zero = _zero(resolve(sets=["deepspeed.zero_optimization={stage: 3, cpu_offload_param: true}"], env={}).ds_config)
    assert zero["offload_param"] == {"device": "cpu"}


def test_deprecated_gather_fp16_weights_key_gets_its_modern_name_with_a_warning():
    resolved = resolve(env={ENV_DEEPSPEED_CONFIG: str(LEGACY_JSON)})
    zero = _zero(resolved.ds_config)
    assert zero["stage3_gather_16bit_weights_on_model_save"] is True
    assert "stage3_gather_fp16_weights_on_model_save" not in zero
    assert any("stage3_gather_fp16_weights_on_model_save is deprecated" in w for w in resolved.warnings)


def test_modern_gather_key_wins_over_the_deprecated_one_given_with_it():
    sets = ["deepspeed.zero_optimization={stage: 3, stage3_gather_fp16_weights_on_model_save: true, "
            "stage3_gather_16bit_weights_on_model_save: false}"]
    zero = _zero(resolve(sets=sets, env={}).ds_config)
    assert zero["stage3_gather_16bit_weights_on_model_save"] is False
    assert "stage3_gather_fp16_weights_on_model_save" not in zero


def test_deprecation_warning_names_the_file_that_used_the_old_key():
    resolved = resolve(env={ENV_DEEPSPEED_CONFIG: str(LEGACY_JSON)})
    assert all(w.startswith(f"{ENV_DEEPSPEED_CONFIG} ({LEGACY_JSON})") for w in resolved.warnings)


@pytest.mark.parametrize(("value", "stage"), [("true", 1), ("false", 0)])
def test_zero_optimization_boolean_is_read_as_a_stage(value, stage):
    resolved = resolve(sets=[f"deepspeed.zero_optimization={value}"], env={})
    assert _zero(resolved.ds_config) == {"stage": stage}
    assert any("deprecated" in w for w in resolved.warnings)


def test_deprecation_warnings_go_to_stderr_and_leave_stdout_pure_json():
    result = CliRunner().invoke(app, ["config", "--deepspeed-json", "--accelerator", "cpu", "--gpus", "1"],
                                env={ENV_DEEPSPEED_CONFIG: str(LEGACY_JSON)})
    assert result.exit_code == 0, result.output
    assert _zero(json.loads(result.stdout))["offload_optimizer"]["device"] == "cpu"
    assert "cpu_offload is deprecated" in result.stderr
