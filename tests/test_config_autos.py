"""Every "auto" the Hugging Face Trainer fills is filled from the run config and the model width by
the Trainer's own rule, and `--explain` names the rule that filled each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dstrain.config.layers import ENV_DEEPSPEED_CONFIG
from dstrain.config.resolve import resolve

WIDTH = 96
TRAIN = ["train.micro_batch_size=3", "train.grad_accum_steps=2", "train.grad_clip=0.5", "train.lr=2e-4",
         "train.betas=[0.8, 0.9]", "train.eps=1e-6", "train.weight_decay=0.05", "train.warmup_steps=7",
         "train.max_steps=70", f"model.d_model={WIDTH}", "model.n_head=4"]
ALL_AUTO = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto"},
}


@pytest.fixture
def hf_json(tmp_path) -> Path:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ALL_AUTO))
    return path


def _resolve(path: Path, sets: list[str] = TRAIN, accelerator: str = "cpu"):
    return resolve(sets=sets, world_size=4, accelerator=accelerator, env={ENV_DEEPSPEED_CONFIG: str(path)})


def _get(ds: dict, path: str):
    for part in path.split("."):
        ds = ds[part]
    return ds


@pytest.mark.parametrize(("key", "value", "rule"), [
    ("train_micro_batch_size_per_gpu", 3, "auto: follows train.micro_batch_size"),
    ("gradient_accumulation_steps", 2, "auto: follows train.grad_accum_steps"),
    ("train_batch_size", 3 * 2 * 4, "auto: follows train.global_batch_size (derived: micro 3 x accum 2 x world 4)"),
    ("gradient_clipping", 0.5, "auto: follows train.grad_clip"),
    ("optimizer.params.lr", 2e-4, "auto: follows train.lr"),
    ("optimizer.params.betas", [0.8, 0.9], "auto: follows train.betas"),
    ("optimizer.params.eps", 1e-6, "auto: follows train.eps"),
    ("optimizer.params.weight_decay", 0.05, "auto: follows train.weight_decay"),
    ("scheduler.params.warmup_min_lr", 0.0, "auto: 0, as the Hugging Face Trainer fills it"),
    ("scheduler.params.warmup_max_lr", 2e-4, "auto: train.lr"),
    ("scheduler.params.warmup_num_steps", 7, "auto: train.warmup_steps"),
    ("scheduler.params.total_num_steps", 70, "auto: train.max_steps"),
    ("zero_optimization.reduce_bucket_size", WIDTH * WIDTH, f"auto: hidden^2 from model.d_model={WIDTH}"),
    ("zero_optimization.stage3_prefetch_bucket_size", int(0.9 * WIDTH * WIDTH),
     f"auto: 0.9 x hidden^2 from model.d_model={WIDTH}"),
    ("zero_optimization.stage3_param_persistence_threshold", 10 * WIDTH,
     f"auto: 10 x hidden from model.d_model={WIDTH}"),
])
def test_each_auto_is_filled_by_the_trainers_rule_and_explained(hf_json, key, value, rule):
    resolved = _resolve(hf_json)
    assert _get(resolved.ds_config, key) == value
    assert resolved.sources[f"deepspeed.{key}"].startswith(rule)


@pytest.mark.parametrize(("accelerator", "sets", "on"), [
    ("cpu", [], None), ("cuda", [], "bf16"), ("cuda", ["train.precision=fp16"], "fp16")])
def test_fp16_and_bf16_enabled_auto_follow_the_precision(hf_json, accelerator, sets, on):
    resolved = _resolve(hf_json, TRAIN + sets, accelerator)
    for name in ("fp16", "bf16"):
        enabled = resolved.ds_config.get(name, {}).get("enabled", False)
        assert enabled is (name == on)
    if on:
        assert resolved.sources[f"deepspeed.{on}.enabled"].startswith("auto: follows train.precision")


def test_a_user_models_width_comes_from_its_kwargs_when_they_name_it(hf_json):
    resolved = _resolve(hf_json, TRAIN + ["model.name=my_models:build", "model.kwargs={hidden_size: 64}"])
    assert resolved.ds_config["zero_optimization"]["reduce_bucket_size"] == 64 * 64
    assert resolved.sources["deepspeed.zero_optimization.reduce_bucket_size"] == \
        "auto: hidden^2 from model.kwargs.hidden_size=64"


def test_a_user_model_of_unknown_width_gets_deepspeeds_defaults_and_says_why(hf_json):
    resolved = _resolve(hf_json, TRAIN + ["model.name=my_models:build"])
    zero = resolved.ds_config["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"],
            zero["stage3_param_persistence_threshold"]) == (500_000_000, 50_000_000, 100_000)
    assert resolved.sources["deepspeed.zero_optimization.reduce_bucket_size"] == (
        "auto: DeepSpeed's default (the width of my_models:build is not known without building it)")


def test_any_other_auto_in_a_deepspeed_model_section_is_deepspeeds_default(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2, "overlap_comm": "auto", "sub_group_size": "auto"}}))
    resolved = _resolve(path)
    assert resolved.ds_config["zero_optimization"]["sub_group_size"] == 1_000_000_000
    assert resolved.sources["deepspeed.zero_optimization.sub_group_size"] == \
        "auto: DeepSpeed's DeepSpeedZeroConfig's default"
    assert "overlap_comm" not in resolved.ds_config["zero_optimization"]  # no literal default: DeepSpeed decides


def test_no_auto_is_left_anywhere(hf_json):
    assert '"auto"' not in json.dumps(_resolve(hf_json).ds_config)


def test_an_auto_nested_under_a_key_deepspeed_ignores_is_left_out_of_the_json(tmp_path):
    # Found by the fuzz test: a misplaced section holding "auto" one level down.
    from dstrain.config.resolve import resolve
    ds_file = tmp_path / "ds.yaml"
    ds_file.write_text("allgather_bucket_size:\n  allgather_bucket_size: auto\n  keep: 3\n")
    resolved = resolve(None, None, [], world_size=1, accelerator="cuda",
                       env={"PL_DEEPSPEED_CONFIG_PATH": str(ds_file)})
    assert resolved.ds_config["allgather_bucket_size"] == {"keep": 3}
    assert any("allgather_bucket_size" in w and "DeepSpeed ignores it" in w for w in resolved.warnings)
