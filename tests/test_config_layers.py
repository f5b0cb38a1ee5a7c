"""Layer precedence, one test per boundary: default < preset < --config < PL_DEEPSPEED_CONFIG_PATH < --set.

Each test also pins the `sources` label that `dstrain config --explain` shows for the winning layer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dstrain.config.layers import ENV_DEEPSPEED_CONFIG
from dstrain.config.resolve import resolve
from dstrain.errors import UserError

BUCKET = "deepspeed.zero_optimization.reduce_bucket_size"
STAGE = "deepspeed.zero_optimization.stage"


def _yaml(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _ds_json(tmp_path: Path, ds: dict, name: str = "ds.json") -> tuple[Path, dict[str, str]]:
    """A DeepSpeed JSON and the environment that points PL_DEEPSPEED_CONFIG_PATH at it."""
    path = tmp_path / name
    path.write_text(json.dumps(ds))
    return path, {ENV_DEEPSPEED_CONFIG: str(path)}


def test_defaults_apply_when_no_layer_sets_a_key():
    resolved = resolve(env={})
    assert resolved.config.train.lr == 1e-3
    assert resolved.sources["train.lr"] == "default"
    assert resolved.preset is None and "zero_optimization" not in resolved.ds_config


def test_preset_overrides_defaults():
    resolved = resolve(preset="stage2", env={})
    assert resolved.ds_config["zero_optimization"]["stage"] == 2
    assert resolved.sources[STAGE] == "preset stage2"
    assert resolved.sources["train.lr"] == "default"


def test_config_file_overrides_the_preset_key_by_key(tmp_path):
    path = _yaml(tmp_path, "deepspeed:\n  zero_optimization:\n    reduce_bucket_size: 1000\n")
    resolved = resolve(preset="stage2", config_file=path, env={})
    zero = resolved.ds_config["zero_optimization"]
    assert zero["reduce_bucket_size"] == 1000
    assert resolved.sources[BUCKET] == f"--config {path}"
    preset_zero = resolve(preset="stage2", env={}).ds_config["zero_optimization"]
    assert zero["allgather_bucket_size"] == preset_zero["allgather_bucket_size"]  # not in the file: the preset's
    assert resolved.sources[STAGE] == "preset stage2"


def test_env_deepspeed_config_overrides_the_config_file(tmp_path):
    path = _yaml(tmp_path, "deepspeed:\n  zero_optimization:\n    stage: 1\n")
    ds_path, env = _ds_json(tmp_path, {"zero_optimization": {"stage": 3}})
    resolved = resolve(config_file=path, env=env)
    assert resolved.ds_config["zero_optimization"]["stage"] == 3
    assert resolved.sources[STAGE] == f"{ENV_DEEPSPEED_CONFIG} ({ds_path})"


def test_set_overrides_the_env_deepspeed_config(tmp_path):
    _, env = _ds_json(tmp_path, {"zero_optimization": {"stage": 3, "reduce_bucket_size": 1000}})
    resolved = resolve(sets=[f"{BUCKET}=2000"], env=env)
    zero = resolved.ds_config["zero_optimization"]
    assert (zero["stage"], zero["reduce_bucket_size"]) == (3, 2000)
    assert resolved.sources[BUCKET] == "--set"


def test_set_overrides_the_config_file(tmp_path):
    path = _yaml(tmp_path, "train:\n  max_steps: 50\n")
    resolved = resolve(config_file=path, sets=["train.max_steps=70"], env={})
    assert resolved.config.train.max_steps == 70
    assert resolved.sources["train.max_steps"] == "--set"


def test_later_set_wins_over_an_earlier_one():
    resolved = resolve(sets=["train.max_steps=5", "train.max_steps=9"], env={})
    assert resolved.config.train.max_steps == 9


def test_config_file_keys_are_attributed_to_the_file(tmp_path):
    path = _yaml(tmp_path, "train:\n  max_steps: 50\n")
    assert resolve(config_file=path, env={}).sources["train.max_steps"] == f"--config {path}"


def test_config_file_can_name_its_preset(tmp_path):
    path = _yaml(tmp_path, "preset: stage2_offload\ndeepspeed:\n  zero_optimization:\n    reduce_bucket_size: 1000\n")
    resolved = resolve(config_file=path, env={})
    zero = resolved.ds_config["zero_optimization"]
    assert resolved.preset == "stage2_offload"
    assert zero["offload_optimizer"]["device"] == "cpu"
    assert resolved.sources["deepspeed.zero_optimization.offload_optimizer.device"] == "preset stage2_offload"
    assert zero["reduce_bucket_size"] == 1000  # the file still overrides its own preset
    assert resolved.sources[BUCKET] == f"--config {path}"


def test_preset_option_wins_over_the_preset_named_in_the_config_file(tmp_path):
    path = _yaml(tmp_path, "preset: stage3\n")
    resolved = resolve(preset="stage1", config_file=path, env={})
    assert resolved.preset == "stage1"
    assert resolved.ds_config["zero_optimization"]["stage"] == 1


def test_env_deepspeed_config_replaces_the_whole_deepspeed_section_below_it(tmp_path):
    # As in PyTorch Lightning: the file is the DeepSpeed config, not a patch on the preset's.
    path = _yaml(tmp_path, "deepspeed:\n  steps_per_print: 7\ntrain:\n  max_steps: 50\n")
    _, env = _ds_json(tmp_path, {"zero_optimization": {"stage": 1}})
    resolved = resolve(preset="stage3_offload", config_file=path, env=env)
    ds = resolved.ds_config
    assert ds["zero_optimization"] == {"stage": 1}
    assert "activation_checkpointing" not in ds and "steps_per_print" not in ds
    assert resolved.config.train.max_steps == 50  # dstrain's own sections are untouched


def test_set_still_wins_over_the_env_deepspeed_config_that_replaced_the_preset(tmp_path):
    _, env = _ds_json(tmp_path, {"zero_optimization": {"stage": 1}})
    resolved = resolve(preset="stage3", sets=["deepspeed.zero_optimization.stage=2"], env=env)
    assert resolved.ds_config["zero_optimization"] == {"stage": 2}
    assert resolved.sources[STAGE] == "--set"


def test_empty_env_deepspeed_config_variable_is_ignored():
    resolved = resolve(preset="stage2", env={ENV_DEEPSPEED_CONFIG: ""})
    assert resolved.sources[STAGE] == "preset stage2"


def test_set_of_a_mapping_merges_into_the_section_key_by_key():
    resolved = resolve(preset="stage3_offload", sets=["deepspeed.zero_optimization={reduce_bucket_size: 1000}"], env={})
    zero = resolved.ds_config["zero_optimization"]
    assert zero["reduce_bucket_size"] == 1000 and resolved.sources[BUCKET] == "--set"
    assert zero["offload_param"]["device"] == "cpu"
    assert resolved.sources[STAGE] == "preset stage3_offload"


def test_preset_cannot_be_changed_with_set():
    # It used to be ignored silently: the preset is chosen before the layers are merged.
    with pytest.raises(UserError) as caught:
        resolve(preset="stage1", sets=["preset=stage3"], env={})
    assert "--preset NAME" in str(caught.value)
