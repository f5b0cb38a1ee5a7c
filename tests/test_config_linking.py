"""Quantities with two spellings (train.* and a DeepSpeed key) are one setting: the higher layer wins
whichever spelling it uses and the other follows; two values in one layer are an error. The global
batch obeys train_batch_size == micro x grad accum x world size."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from dstrain.config.layers import get_path, set_path
from dstrain.config.resolve import resolve
from dstrain.errors import UserError

# (train spelling, DeepSpeed spelling, value in --config, value in --set)
LINKED = [
    ("train.micro_batch_size", "deepspeed.train_micro_batch_size_per_gpu", 16, 4),
    ("train.grad_accum_steps", "deepspeed.gradient_accumulation_steps", 2, 3),
    ("train.lr", "deepspeed.optimizer.params.lr", 0.01, 0.0003),
    ("train.grad_clip", "deepspeed.gradient_clipping", 0.5, 2.0),
    ("train.weight_decay", "deepspeed.optimizer.params.weight_decay", 0.2, 0.01),
    ("train.eps", "deepspeed.optimizer.params.eps", 1e-6, 1e-7),
]
IDS = [train for train, *_ in LINKED]


def _config(tmp_path: Path, values: dict[str, Any]) -> Path:
    """A --config file setting dotted paths, e.g. {"train.lr": 0.1}."""
    data: dict[str, Any] = {}
    for path, value in values.items():
        set_path(data, path, value)
    if "optimizer" in data.get("deepspeed", {}):
        data["deepspeed"]["optimizer"]["type"] = "AdamW"
    file = tmp_path / "run.yaml"
    file.write_text(yaml.safe_dump(data))
    return file


def _both(resolved, train_path: str, ds_path: str) -> tuple[Any, Any]:
    return get_path(resolved.config.model_dump(), train_path), get_path(resolved.ds_config, ds_path.split(".", 1)[1])


@pytest.mark.parametrize(("train_path", "ds_path", "low", "high"), LINKED, ids=IDS)
def test_train_spelling_in_a_higher_layer_wins_over_the_deepspeed_spelling(tmp_path, train_path, ds_path, low, high):
    resolved = resolve(config_file=_config(tmp_path, {ds_path: low}), sets=[f"{train_path}={high}"], env={})
    assert _both(resolved, train_path, ds_path) == (high, high)
    assert resolved.sources[train_path] == "--set"
    assert resolved.sources[ds_path] == f"follows {train_path} (--set)"


@pytest.mark.parametrize(("train_path", "ds_path", "low", "high"), LINKED, ids=IDS)
def test_deepspeed_spelling_in_a_higher_layer_wins_over_the_train_spelling(tmp_path, train_path, ds_path, low, high):
    resolved = resolve(config_file=_config(tmp_path, {train_path: low}), sets=[f"{ds_path}={high}"], env={})
    assert _both(resolved, train_path, ds_path) == (high, high)
    assert resolved.sources[train_path] == f"--set (as {ds_path})"


@pytest.mark.parametrize(("train_path", "ds_path", "low", "high"), LINKED, ids=IDS)
def test_both_spellings_with_different_values_in_one_layer_is_an_error_naming_both(tmp_path, train_path, ds_path,
                                                                                  low, high):
    path = _config(tmp_path, {train_path: low, ds_path: high})
    with pytest.raises(UserError) as caught:
        resolve(config_file=path, env={})
    message = str(caught.value)
    assert train_path in message and ds_path in message
    assert f"--config {path}" in message
    assert "set only one of" in message


@pytest.mark.parametrize(("train_path", "ds_path", "low", "high"), LINKED, ids=IDS)
def test_both_spellings_with_the_same_value_in_one_layer_agree(tmp_path, train_path, ds_path, low, high):
    resolved = resolve(config_file=_config(tmp_path, {train_path: low, ds_path: low}), env={})
    assert _both(resolved, train_path, ds_path) == (low, low)


def test_betas_follow_the_deepspeed_spelling_from_a_higher_layer(tmp_path):
    resolved = resolve(config_file=_config(tmp_path, {"train.betas": [0.9, 0.95]}),
                       sets=["deepspeed.optimizer.params.betas=[0.8, 0.99]"], env={})
    assert list(resolved.config.train.betas) == [0.8, 0.99]
    assert resolved.ds_config["optimizer"]["params"]["betas"] == [0.8, 0.99]


def test_deepspeed_optimizer_set_partially_still_names_its_type():
    # A section holding only params.lr used to reach DeepSpeed without "type".
    # The other Adam settings keep train.*'s values, not DeepSpeed's defaults.
    optimizer = resolve(sets=["deepspeed.optimizer.params.lr=3e-4"], env={}).ds_config["optimizer"]
    assert optimizer == {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                     "weight_decay": 0.1}}


def test_precision_from_a_higher_layer_wins_over_a_deepspeed_bf16_section(tmp_path):
    path = _config(tmp_path, {"deepspeed.bf16.enabled": True})
    resolved = resolve(config_file=path, sets=["train.precision=fp16"], env={})
    assert resolved.precision == "fp16"
    assert resolved.ds_config["fp16"]["enabled"] is True
    assert resolved.ds_config.get("bf16", {}).get("enabled", False) is False


def test_deepspeed_fp16_section_from_a_higher_layer_sets_the_precision(tmp_path):
    path = _config(tmp_path, {"train.precision": "bf16"})
    resolved = resolve(config_file=path, sets=["deepspeed.fp16.enabled=true"], accelerator="cuda", env={})
    assert resolved.precision == "fp16"
    assert resolved.sources["train.precision"] == "--set (as deepspeed.fp16.enabled)"


def test_precision_and_a_different_deepspeed_section_in_one_layer_is_an_error(tmp_path):
    path = _config(tmp_path, {"train.precision": "fp16", "deepspeed.bf16.enabled": True})
    with pytest.raises(UserError) as caught:
        resolve(config_file=path, env={})
    assert "train.precision=fp16 but deepspeed.bf16.enabled is true" in str(caught.value)


def test_auto_precision_is_bf16_on_cuda_and_fp32_on_cpu():
    assert resolve(accelerator="cuda", env={}).precision == "bf16"
    assert resolve(accelerator="cpu", env={}).precision == "fp32"


def test_global_batch_derives_grad_accum_when_divisible(tmp_path):
    path = _config(tmp_path, {"train.global_batch_size": 16, "train.micro_batch_size": 4})
    resolved = resolve(config_file=path, world_size=2, env={})
    assert resolved.config.train.grad_accum_steps == 2
    assert resolved.ds_config["gradient_accumulation_steps"] == 2
    assert resolved.ds_config["train_batch_size"] == 16
    assert resolved.sources["train.grad_accum_steps"].startswith("derived: global 16")


def test_deepspeed_train_batch_size_derives_grad_accum_for_each_world_size():
    for world, accum in ((1, 8), (2, 4), (8, 1)):
        resolved = resolve(sets=["deepspeed.train_batch_size=64"], world_size=world, env={})
        assert resolved.config.train.grad_accum_steps == accum, world


def test_global_batch_not_divisible_by_micro_times_world_is_an_error_naming_the_sources(tmp_path):
    path = _config(tmp_path, {"train.global_batch_size": 10, "train.micro_batch_size": 4})
    with pytest.raises(UserError) as caught:
        resolve(config_file=path, world_size=2, env={})
    message = str(caught.value)
    assert f"global batch 10 (--config {path})" in message
    assert f"micro batch 4 (--config {path})" in message
    assert "world size 2" in message
    assert "divisible by micro x world = 8" in message


def test_global_batch_contradicting_an_explicit_grad_accum_suggests_the_right_one(tmp_path):
    path = _config(tmp_path, {"train.global_batch_size": 64})
    with pytest.raises(UserError) as caught:
        resolve(config_file=path, sets=["train.grad_accum_steps=4"], world_size=1, env={})
    assert "set train.grad_accum_steps=8" in str(caught.value)


def test_global_batch_unset_is_micro_times_accum_times_world():
    resolved = resolve(sets=["train.micro_batch_size=3", "train.grad_accum_steps=5"], world_size=7, env={})
    assert resolved.ds_config["train_batch_size"] == 105
    assert resolved.sources["train.global_batch_size"] == "derived: micro 3 x accum 5 x world 7"


def test_huge_global_batch_mismatch_is_reported_at_once():
    # The fix used to be found by trying every accumulation count up to the global batch: 1e11 hung.
    start = time.perf_counter()
    with pytest.raises(UserError, match="global batch 100000000007"):
        resolve(sets=["train.global_batch_size=100000000007", "train.grad_accum_steps=3"], env={})
    assert time.perf_counter() - start < 1.0


# train.compile "auto": on only where compiling was measured faster (docs/benchmarks.md).
@pytest.mark.parametrize("preset, sets, accelerator, compiled", [
    ("stage1", [], "cuda", True),
    ("stage2", [], "cuda", True),
    ("stage2", [], "cpu", False),                                     # CPU ranks: never
    ("stage3", [], "cuda", False),                                    # ZeRO-3 measured no faster
    ("stage2_offload", [], "cuda", False),                            # not measured
    ("stage2", ["train.activation_checkpointing=true"], "cuda", False),
    ("stage2", ["train.precision=fp32"], "cuda", False),
    ("stage2", ["model.name=my_models:build"], "cuda", False),        # a user's model opts in
    ("stage3", ["train.compile=true"], "cuda", True),                 # an explicit choice stands
    ("stage2", ["train.compile=false"], "cuda", False),
])
def test_compile_auto_is_on_only_where_it_was_measured_to_help(preset, sets, accelerator, compiled):
    resolved = resolve(preset=preset, sets=sets, world_size=2, accelerator=accelerator, env={})
    assert resolved.config.train.compile is compiled
    if any(s.startswith("train.compile") for s in sets):
        assert resolved.sources["train.compile"] == "--set"
    else:
        assert resolved.sources["train.compile"].startswith("auto: " + ("on" if compiled else "off"))


def test_compile_with_zero3_is_warned_about():
    resolved = resolve(preset="stage3", sets=["train.compile=true"], accelerator="cuda", env={})
    assert any("train.compile" in w and "stage 3" in w for w in resolved.warnings)


@pytest.mark.parametrize("preset, world, accelerator, warned", [
    ("stage3", 1, "cuda", True),
    ("stage3", 2, "cuda", False),
    ("stage3", 1, "cpu", False),
    ("stage3_offload", 1, "cuda", False),  # parameter offload is what stage 3 is there for
    ("stage2", 1, "cuda", False),
])
def test_stage3_on_one_gpu_is_warned_about_with_the_measured_cost(preset, world, accelerator, warned):
    resolved = resolve(preset=preset, world_size=world, accelerator=accelerator, env={})
    hits = [w for w in resolved.warnings if "stage 3 on one GPU" in w]
    assert bool(hits) is warned
    if warned:
        assert "stage2" in hits[0] and "0.95-1.00 on a 913M and a 1.3B" in hits[0] and "0.99-1.03" in hits[0]
