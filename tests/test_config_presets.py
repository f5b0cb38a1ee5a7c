"""Every shipped preset, read from the presets directory (a new preset file is covered without edits here),
loads and resolves through the real code path into an explicit DeepSpeed JSON."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from typer.testing import CliRunner

from dstrain.cli import app
from dstrain.config.presets import PRESET_ORDER, available, description, presets_dir
from dstrain.config.resolve import AUTO, resolve
from dstrain.errors import UserError

PRESET_FILES = sorted(presets_dir().glob("*.yaml"))
NAMES = [path.stem for path in PRESET_FILES]
BATCH_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
NO_ENV: dict[str, str] = {}  # resolve without the caller's PL_DEEPSPEED_CONFIG_PATH

# (ZeRO stage, offload_optimizer device, offload_param device); None: no offload section.
EXPECTED_PLACEMENT = {
    "stage1": (1, None, None),
    "stage2": (2, None, None),
    "stage2_offload": (2, "cpu", None),
    "stage3": (3, None, None),
    "stage3_offload": (3, "cpu", "cpu"),
    "stage3_nvme": (3, "nvme", "nvme"),
}


def _leaves(node: Any) -> list[Any]:
    if isinstance(node, dict):
        return [leaf for value in node.values() for leaf in _leaves(value)]
    if isinstance(node, list):
        return [leaf for value in node for leaf in _leaves(value)]
    return [node]


def _header(name: str) -> list[str]:
    """The comment lines a preset file opens with."""
    lines = (presets_dir() / f"{name}.yaml").read_text().splitlines()
    return [line for line in lines[: next(i for i, line in enumerate(lines) if not line.startswith("#"))]]


def test_the_presets_directory_holds_the_six_documented_presets():
    assert set(PRESET_ORDER) <= set(NAMES)
    assert available()[: len(PRESET_ORDER)] == list(PRESET_ORDER)
    assert sorted(available()) == sorted(NAMES)


@pytest.mark.parametrize("accelerator", ["cuda", "cpu"])
@pytest.mark.parametrize("world", [1, 8])
@pytest.mark.parametrize("name", NAMES)
def test_preset_renders_an_explicit_deepspeed_json(name, world, accelerator):
    resolved = resolve(preset=name, world_size=world, accelerator=accelerator, env=NO_ENV)
    ds = resolved.ds_config

    assert json.loads(json.dumps(ds, allow_nan=False)) == ds  # strict JSON, round-trips
    assert AUTO not in _leaves(ds)
    for key in BATCH_KEYS:
        assert type(ds[key]) is int, key
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * world
    assert ds["optimizer"]["type"] and ds["optimizer"]["params"]["lr"] == resolved.config.train.lr
    assert ds["scheduler"]["type"]
    expected_precision = "bf16" if accelerator == "cuda" else "fp32"
    assert resolved.precision == expected_precision
    assert ds.get("bf16", {}).get("enabled", False) is (expected_precision == "bf16")
    assert ds.get("fp16", {}).get("enabled", False) is False


@pytest.mark.parametrize("name", NAMES)
def test_preset_sizes_are_written_as_integers(name):
    zero = resolve(preset=name, env=NO_ENV).ds_config["zero_optimization"]
    for key, value in zero.items():
        if key.endswith(("_size", "_parameters", "_distance", "_threshold")):
            assert type(value) is int and value >= (0 if key.endswith("_distance") else 1), key  # 0: no reuse


@pytest.mark.parametrize("name", NAMES)
def test_preset_named_stageN_has_zero_stage_N(name):
    stage = resolve(preset=name, env=NO_ENV).ds_config["zero_optimization"]["stage"]
    assert stage in (0, 1, 2, 3)
    match = re.match(r"stage(\d)", name)
    if match:
        assert stage == int(match.group(1))


@pytest.mark.parametrize(("name", "placement"), sorted(EXPECTED_PLACEMENT.items()))
def test_preset_places_states_on_the_documented_devices(name, placement):
    stage, optimizer_device, param_device = placement
    zero = resolve(preset=name, env=NO_ENV).ds_config["zero_optimization"]
    assert zero["stage"] == stage
    assert (zero.get("offload_optimizer") or {}).get("device") == optimizer_device
    assert (zero.get("offload_param") or {}).get("device") == param_device


def test_stage3_nvme_swaps_params_and_optimizer_to_an_nvme_path():
    zero = resolve(preset="stage3_nvme", env=NO_ENV).ds_config["zero_optimization"]
    for part in ("offload_param", "offload_optimizer"):
        assert zero[part]["device"] == "nvme"
        assert zero[part]["nvme_path"].startswith("/")


def test_stage2_offload_puts_the_optimizer_on_cpu_with_stage_2():
    zero = resolve(preset="stage2_offload", env=NO_ENV).ds_config["zero_optimization"]
    assert (zero["stage"], zero["offload_optimizer"]["device"]) == (2, "cpu")
    assert "offload_param" not in zero


@pytest.mark.parametrize("spelling", ["stage3-nvme", "Stage3_NVMe", "STAGE3-NVME", " stage3_nvme "])
def test_preset_names_accept_dashes_underscores_and_any_case(spelling):
    canonical = resolve(preset="stage3_nvme", env=NO_ENV)
    resolved = resolve(preset=spelling, env=NO_ENV)
    assert resolved.preset == "stage3_nvme"
    assert resolved.ds_config == canonical.ds_config
    assert resolved.sources["deepspeed.zero_optimization.stage"] == "preset stage3_nvme"


def test_preset_named_in_a_config_file_accepts_any_spelling(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("preset: Stage2-Offload\n")
    assert resolve(config_file=path, env=NO_ENV).preset == "stage2_offload"


@pytest.mark.parametrize("name", NAMES)
def test_preset_file_opens_with_what_it_trades_and_the_command_that_runs_it(name):
    header = "\n".join(_header(name))
    assert header.startswith(f"# {name} — ")
    assert "Trades:" in header
    assert f"dstrain run --preset {name}" in header
    assert len(description(name)) > 20  # the line `dstrain presets` shows


@pytest.mark.parametrize("name", NAMES)
def test_activation_checkpointing_can_be_switched_on_for_each_preset(name):
    resolved = resolve(preset=name, sets=["train.activation_checkpointing=true"], env=NO_ENV)
    assert resolved.config.train.activation_checkpointing is True
    assert resolved.sources["train.activation_checkpointing"] == "--set"
    options = resolved.ds_config["activation_checkpointing"]
    assert isinstance(options["partition_activations"], bool)
    assert isinstance(options["cpu_checkpointing"], bool)


@pytest.mark.parametrize("name", NAMES)
def test_activation_checkpointing_options_can_be_overridden_for_each_preset(name):
    resolved = resolve(preset=name, env=NO_ENV, sets=[
        "train.activation_checkpointing=true",
        "deepspeed.activation_checkpointing.cpu_checkpointing=true",
        "deepspeed.activation_checkpointing.partition_activations=true"])
    options = resolved.ds_config["activation_checkpointing"]
    assert options["cpu_checkpointing"] is True and options["partition_activations"] is True


def test_presets_command_lists_every_preset_file():
    result = CliRunner().invoke(app, ["presets"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for name in NAMES:
        assert name in result.stdout
    assert "dstrain run --preset NAME" in result.stdout


def test_presets_command_shows_one_preset_file_by_any_spelling():
    result = CliRunner().invoke(app, ["presets", "Stage3-Offload"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert (presets_dir() / "stage3_offload.yaml").read_text() in result.stdout


def test_nvme_parameters_held_for_reuse_are_warned_about_and_the_preset_releases_them():
    """Parameters kept for reuse hold NVMe swap buffers: DeepSpeed 0.19.8 ran out of them at step 2 of a
    1.3B GPT (docs/benchmarks.md, finding 23). The stage3_nvme preset releases them; a config that keeps
    them is told where and what to set."""
    preset = resolve(preset="stage3_nvme", env=NO_ENV)
    assert preset.ds_config["zero_optimization"]["stage3_max_reuse_distance"] == 0
    assert not any("stage3_max_reuse_distance" in w for w in preset.warnings)
    kept = resolve(preset="stage3_nvme", sets=["deepspeed.zero_optimization.stage3_max_reuse_distance=1000000000"],
                   env=NO_ENV)
    warning = next(w for w in kept.warnings if "stage3_max_reuse_distance" in w)
    assert "--set" in warning and "1,000,000,000" in warning and "set it to 0" in warning
    assert not any("stage3_max_reuse_distance" in w for w in resolve(preset="stage3_offload", env=NO_ENV).warnings)


def test_partial_optimizer_offload_is_warned_about():
    """offload_optimizer.ratio < 1 sends part of ZeRO-3's optimizer to a second optimizer that DeepSpeed
    0.19.8 never gives the scheduler's learning rate and leaves out of checkpoints; it also measured 4-5x
    slower (docs/benchmarks.md, finding 25). The presets do not set it; a config that does is told."""
    key = "deepspeed.zero_optimization.offload_optimizer.ratio"
    assert not any("offload_optimizer.ratio" in w for w in resolve(preset="stage3_offload", env=NO_ENV).warnings)
    partial = resolve(preset="stage3_offload", sets=[f"{key}=0.5"], env=NO_ENV)
    warning = next(w for w in partial.warnings if "offload_optimizer.ratio" in w)
    assert "--set" in warning and "0.5" in warning and "learning rate" in warning and "remove the key" in warning
    assert not any("offload_optimizer.ratio" in w for w in resolve(preset="stage3_offload", sets=[f"{key}=1.0"],
                                                                 env=NO_ENV).warnings)
    # ZeRO-1/2 has no partial offload: DeepSpeed's DeepSpeedZeroConfig refuses the key there, and so does dstrain
    with pytest.raises(UserError) as refused:
        resolve(preset="stage2_offload", sets=[f"{key}=0.5"], env=NO_ENV)
    assert "Partial offloading only supported for ZeRO Stage 3" in str(refused.value)
