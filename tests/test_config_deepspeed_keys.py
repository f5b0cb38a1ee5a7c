"""Unknown DeepSpeed keys: a key DeepSpeed ignores is a warning, a likely misspelling of a key it reads
is an error, a key DeepSpeed's own models refuse is an error, and --strict / DSTRAIN_STRICT=1 makes
every warning an error. Values are bounded exactly as DeepSpeed's own config models bound them."""

from __future__ import annotations

import importlib.metadata
import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dstrain.cli import app
from dstrain.config import deepspeed_keys as dsk
from dstrain.config.layers import ENV_DEEPSPEED_CONFIG
from dstrain.config.resolve import ENV_STRICT, resolve
from dstrain.errors import UserError

DEEPSPEED = tuple(int(part) for part in importlib.metadata.version("deepspeed").split(".")[:2])


def _ds_file(tmp_path: Path, ds: dict) -> Path:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    return path


def _resolve_ds(tmp_path: Path, ds: dict, **env: str):
    path = _ds_file(tmp_path, ds)
    return resolve(world_size=2, accelerator="cpu", env={ENV_DEEPSPEED_CONFIG: str(path), **env}), path


def _fails(tmp_path: Path, ds: dict, **env: str) -> tuple[str, Path]:
    path = _ds_file(tmp_path, ds)
    with pytest.raises(UserError) as caught:
        resolve(world_size=2, accelerator="cpu", env={ENV_DEEPSPEED_CONFIG: str(path), **env})
    return str(caught.value), path


def _cli(args: list[str], env: dict[str, str | None]):
    return CliRunner().invoke(app, ["config", "--accelerator", "cpu", "--gpus", "2", *args],
                              env={ENV_DEEPSPEED_CONFIG: None, ENV_STRICT: None, **env})


# --------------------------------------------------------------------------- the misspelling rule


@pytest.mark.parametrize(("key", "meant"), [
    ("zero_optimisation", "zero_optimization"),  # British spelling
    ("train_micro_batch_size_per_GPU", "train_micro_batch_size_per_gpu"),  # case
    ("Train-Batch-Size", "train_batch_size"),  # case and separator
    ("trainBatchSize", "train_batch_size"),  # camelCase
    ("gradientaccumulationsteps", "gradient_accumulation_steps"),  # separators dropped
    ("trian_batch_size", "train_batch_size"),  # two letters swapped
    ("gradient_acumulation_steps", "gradient_accumulation_steps"),  # a letter missing
    ("steps_per_prinnt", "steps_per_print"),  # a letter doubled
    ("gradient_clip", "gradient_clipping"),  # a word cut short
])
def test_a_misspelling_is_recognized_as_the_key_it_means(key, meant):
    assert dsk.misspelling_of(key, dsk.TOP_LEVEL_KEYS) == meant


@pytest.mark.parametrize("key", [
    "comms_config", "monitor_config",  # LLaMA-Factory's keys: other names, not typos
    "fp32",  # short keys and other digits are other keys (bf16/fp16 are both real)
    "cuda_visible_devices", "wall_clock",
    "_comment", "#", "//",  # comments written as keys
])
def test_a_foreign_key_is_not_taken_for_a_misspelling(key):
    assert dsk.misspelling_of(key, dsk.TOP_LEVEL_KEYS) is None


def test_offload_optimiser_is_a_misspelling_of_offload_optimizer():
    assert dsk.misspelling_of("offload_optimiser", dsk.zero_keys().names) == "offload_optimizer"


# --------------------------------------------------------------------------- keys through resolve


def test_a_key_deepspeed_ignores_is_a_warning_naming_the_file_the_path_and_a_suggestion(tmp_path):
    resolved, path = _resolve_ds(tmp_path, {"comms_config": {"verbose": False}, "zero_optimization": {"stage": 2}})
    assert resolved.warnings == [f"{ENV_DEEPSPEED_CONFIG} ({path}): deepspeed.comms_config: unknown DeepSpeed key; "
                                 "DeepSpeed ignores it (did you mean 'comms_logger'?)"]
    assert resolved.ds_config["comms_config"] == {"verbose": False}  # passed on as written; DeepSpeed ignores it


def test_a_misspelt_top_level_key_is_an_error_with_the_key_it_means(tmp_path):
    message, path = _fails(tmp_path, {"train_micro_batch_size_per_GPU": 4})
    assert (f"{ENV_DEEPSPEED_CONFIG} ({path}): deepspeed.train_micro_batch_size_per_GPU: unknown DeepSpeed key, "
            "likely a misspelling of 'train_micro_batch_size_per_gpu'") in message
    assert "fix: did you mean 'train_micro_batch_size_per_gpu'?" in message


@pytest.mark.parametrize(("ds", "path", "meant"), [
    ({"activation_checkpointing": {"partition_activation": True}},
     "activation_checkpointing.partition_activation", "partition_activations"),
    ({"aio": {"queue_dept": 8}}, "aio.queue_dept", "queue_depth"),
    ({"flops_profiler": {"Enabled": True}}, "flops_profiler.Enabled", "enabled"),
    ({"optimizer": {"type": "AdamW", "params": {"weight_decy": 0.0}}}, "optimizer.params.weight_decy", "weight_decay"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 10}}},
     "scheduler.params.warmup_num_step", "warmup_num_steps"),
    ({"optimizer": {"type": "AdamW", "paramz": {}}}, "optimizer.paramz", "params"),
])
def test_a_misspelling_is_an_error_at_every_depth(tmp_path, ds, path, meant):
    message, _ = _fails(tmp_path, ds)
    assert f"deepspeed.{path}: unknown" in message and f"likely a misspelling of {meant!r}" in message


@pytest.mark.parametrize(("ds", "path"), [
    ({"activation_checkpointing": {"my_flag": True}}, "activation_checkpointing.my_flag"),
    ({"flops_profiler": {"team": "x"}}, "flops_profiler.team"),
    ({"aio": {"notes_for_ops": "fast disk"}}, "aio.notes_for_ops"),
])
def test_a_foreign_key_deep_down_is_a_warning(tmp_path, ds, path):
    resolved, _ = _resolve_ds(tmp_path, ds)
    assert any(f"deepspeed.{path}: unknown" in w and "DeepSpeed ignores it" in w for w in resolved.warnings)


@pytest.mark.parametrize(("ds", "path", "says"), [
    ({"zero_optimization": {"stage": 2, "offload_optimiser": {"device": "cpu"}}},
     "zero_optimization.offload_optimiser", "did you mean 'offload_optimizer'?"),
    ({"zero_optimization": {"stage": 2, "my_flag": True}}, "zero_optimization.my_flag", "valid keys:"),
    ({"bf16": {"enabled": True, "my_flag": 1}}, "bf16.my_flag", "valid keys:"),
    ({"tensorboard": {"enabled": False, "output": "x"}}, "tensorboard.output", "did you mean 'output_path'?"),
])
def test_an_unknown_key_where_deepspeeds_model_refuses_it_is_an_error(tmp_path, ds, path, says):
    message, _ = _fails(tmp_path, ds)
    assert f"deepspeed.{path}: unknown" in message and "refuses it (DeepSpeed would stop at start)" in message
    assert says in message


def test_a_key_moved_out_of_zero_optimization_says_where_it_belongs(tmp_path):
    message, _ = _fails(tmp_path, {"zero_optimization": {"stage": 3, "aio": {"block_size": 1048576}}})
    assert "fix: it belongs at the top level: move it to deepspeed.aio" in message


def test_a_key_deepspeed_has_removed_is_an_error_where_the_installed_deepspeed_removed_it(tmp_path):
    ds = {"sparse_attention": {"mode": "fixed"}}
    if DEEPSPEED < (0, 19):  # DeepSpeed 0.18 still accepts sparse_attention: so does dstrain
        resolved, _ = _resolve_ds(tmp_path, ds)
        assert resolved.config.deepspeed["sparse_attention"] == {"mode": "fixed"}
        return
    message, _ = _fails(tmp_path, ds)
    assert "deepspeed.sparse_attention: DeepSpeed has removed this key and refuses configs that have it" in message


def test_comment_keys_are_neither_warnings_nor_errors(tmp_path):
    resolved, _ = _resolve_ds(tmp_path, {"_comment": "ZeRO-2 for 8 GPUs", "zero_optimization": {"stage": 2}})
    assert resolved.warnings == []


def test_strict_env_makes_an_ignored_key_an_error(tmp_path):
    message, path = _fails(tmp_path, {"monitor_config": {"enabled": True}}, **{ENV_STRICT: "1"})
    assert (f"{ENV_DEEPSPEED_CONFIG} ({path}): deepspeed.monitor_config: unknown DeepSpeed key: DeepSpeed "
            "ignores it (an error with --strict / DSTRAIN_STRICT=1)") in message


def test_strict_flag_makes_an_ignored_key_exit_2(tmp_path):
    path = _ds_file(tmp_path, {"monitor_config": {"enabled": True}})
    result = _cli(["--strict"], {ENV_DEEPSPEED_CONFIG: str(path)})
    assert result.exit_code == 2 and result.stdout == ""
    assert "deepspeed.monitor_config: unknown DeepSpeed key: DeepSpeed ignores it" in " ".join(result.stderr.split())


def test_warnings_go_to_stderr_and_leave_the_json_on_stdout_intact(tmp_path):
    path = _ds_file(tmp_path, {"comms_config": {"verbose": False}})
    result = _cli(["--deepspeed-json"], {ENV_DEEPSPEED_CONFIG: str(path)})
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["train_micro_batch_size_per_gpu"] == 8
    assert "warning:" in result.stderr and "deepspeed.comms_config" in result.stderr
    assert "DeepSpeed ignores it" in " ".join(result.stderr.split())


def test_the_deepspeed_section_of_a_config_file_follows_the_same_rule(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("deepspeed:\n  comms_config: {verbose: false}\n")
    resolved = resolve(config_file=path, world_size=2, accelerator="cpu", env={})
    assert resolved.warnings == [f"--config {path}: deepspeed.comms_config: unknown DeepSpeed key; "
                                 "DeepSpeed ignores it (did you mean 'comms_logger'?)"]
    path.write_text("deepspeed:\n  zero_optimisation: {stage: 2}\n")
    with pytest.raises(UserError, match="zero_optimisation: unknown DeepSpeed key, likely a misspelling"):
        resolve(config_file=path, world_size=2, accelerator="cpu", env={})


def test_dstrains_own_sections_stay_strict(tmp_path):
    with pytest.raises(UserError, match=r"train.comms_config: unknown key"):
        resolve(sets=["train.comms_config=1"], world_size=2, accelerator="cpu", env={})


def test_a_deepspeed_json_with_a_trailing_comma_is_read_as_deepspeed_reads_it(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 2,},}\n')
    resolved = resolve(world_size=2, accelerator="cpu", env={ENV_DEEPSPEED_CONFIG: str(path)})
    assert resolved.ds_config["zero_optimization"]["stage"] == 2
    assert "not strict JSON" in resolved.warnings[0] and "hjson" in resolved.warnings[0]


def test_the_old_bfloat16_section_name_is_read_as_bf16(tmp_path):
    resolved, _ = _resolve_ds(tmp_path, {"bfloat16": {"enabled": True}})
    assert resolved.precision == "bf16" and "bfloat16" not in resolved.ds_config
    assert "old name of deepspeed.bf16" in resolved.warnings[0]


# --------------------------------------------------------------------------- values: DeepSpeed's bounds


@pytest.mark.parametrize("key", ["sub_group_size", "stage3_max_live_parameters", "max_live_parameters",
                                 "stage3_max_reuse_distance", "max_reuse_distance", "allgather_bucket_size",
                                 "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"])
def test_zero_is_accepted_where_deepspeed_allows_zero(tmp_path, key):
    resolved, _ = _resolve_ds(tmp_path, {"zero_optimization": {"stage": 3, key: 0}})
    assert resolved.ds_config["zero_optimization"][key] == 0


def test_a_negative_size_is_refused_with_deepspeeds_bound(tmp_path):
    message, path = _fails(tmp_path, {"zero_optimization": {"stage": 3, "sub_group_size": -1}})
    assert ("deepspeed.zero_optimization.sub_group_size: must be at least 0 (got -1), as DeepSpeed's "
            "DeepSpeedZeroConfig requires") in message


def test_zero_lr_and_eps_are_accepted_as_torch_accepts_them(tmp_path):
    resolved, _ = _resolve_ds(tmp_path, {"optimizer": {"type": "AdamW", "params": {"lr": 0, "eps": 0}}})
    assert resolved.ds_config["optimizer"]["params"]["lr"] == 0
    assert resolved.ds_config["optimizer"]["params"]["eps"] == 0


def test_max_grad_norm_in_the_optimizer_params_is_refused_as_deepspeeds_engine_refuses_it(tmp_path):
    # DeepSpeed's config reads it, its engine raises ValueError when it builds the optimizer on every rank.
    message, path = _fails(tmp_path, {"optimizer": {"type": "Adam", "params": {"lr": 1e-4, "max_grad_norm": 1.0}}})
    assert f"({path}): deepspeed.optimizer.params.max_grad_norm: DeepSpeed refuses this key when it builds " \
           "the engine" in message
    assert "clipping is deepspeed.gradient_clipping" in message


def test_reduce_bucket_size_zero_is_refused_where_the_installed_deepspeed_refuses_it(tmp_path):
    ds = {"zero_optimization": {"stage": 2, "reduce_bucket_size": 0}}
    if DEEPSPEED < (0, 19):  # DeepSpeed 0.18 accepts a reduce bucket of 0: so does dstrain
        resolved, _ = _resolve_ds(tmp_path, ds)
        assert resolved.config.deepspeed["zero_optimization"]["reduce_bucket_size"] == 0
        return
    message, _ = _fails(tmp_path, ds)
    assert "deepspeed.zero_optimization.reduce_bucket_size: must be positive (got 0)" in message


@pytest.mark.parametrize("section", sorted(dsk.MODEL_SECTIONS))
def test_key_names_and_bounds_read_from_source_match_deepspeeds_models(section):
    """The ast reading of DeepSpeed's source agrees with the imported pydantic models."""
    import importlib
    rel, class_name = dsk.MODEL_SECTIONS[section]
    module = importlib.import_module("deepspeed." + rel.removesuffix(".py").replace("/", "."))
    model = getattr(module, class_name)
    names = set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}
    ours = dsk.section(section)
    assert ours.names == names
    for name, info in model.model_fields.items():
        theirs = {(type(m).__name__.lower(), float(getattr(m, type(m).__name__.lower())))
                  for m in info.metadata if type(m).__name__ in ("Ge", "Gt", "Le", "Lt")}
        assert {(b.op, float(b.limit)) for b in ours.bounds.get(name, ())} == theirs, name


def test_an_auto_under_a_key_deepspeed_ignores_is_not_an_error_and_not_passed_on(tmp_path):
    resolved, _ = _resolve_ds(tmp_path, {"my_tool_batch": "auto", "zero_optimization": {"stage": 2}})
    assert "my_tool_batch" not in resolved.ds_config
    assert "DeepSpeed ignores it" in resolved.warnings[0]


# --------------------------------------------------------------------------- dstrain run


def _dry_run(tmp_path, monkeypatch, ds: dict, *flags: str):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.delenv(ENV_STRICT, raising=False)
    path = _ds_file(tmp_path, ds)
    return CliRunner().invoke(app, ["run", "--dry-run", "--accelerator", "cpu", "--gpus", "2", *flags],
                              env={ENV_DEEPSPEED_CONFIG: str(path)})


def test_run_shows_the_warning_and_strict_run_refuses(tmp_path, monkeypatch):
    ds = {"comms_config": {"verbose": False}, "zero_optimization": {"stage": 2}}
    result = _dry_run(tmp_path, monkeypatch, ds)
    assert result.exit_code == 0, result.output
    assert "deepspeed.comms_config: unknown DeepSpeed key; DeepSpeed ignores it" in " ".join(result.output.split())
    strict = _dry_run(tmp_path, monkeypatch, ds, "--strict")
    assert strict.exit_code == 2
    assert "DeepSpeed ignores it (an error with --strict" in " ".join(strict.stderr.split())
    assert ENV_STRICT not in os.environ  # --strict does not leak past the command


@pytest.mark.parametrize("stage", ["3", 3.0])
def test_a_stage_written_as_text_or_float_is_read_as_deepspeed_reads_it(tmp_path, stage):
    resolved, _ = _resolve_ds(tmp_path, {"zero_optimization": {"stage": stage}})
    assert resolved.ds_config["zero_optimization"]["stage"] == 3


def test_a_zero_key_written_at_the_top_level_says_where_it_belongs(tmp_path):
    resolved, _ = _resolve_ds(tmp_path, {"zero_quantized_weights": True, "zero_optimization": {"stage": 3}})
    assert resolved.warnings[0].endswith("DeepSpeed ignores it (it belongs in deepspeed.zero_optimization: move it "
                                         "to deepspeed.zero_optimization.zero_quantized_weights)")


def test_aio_keys_read_from_source_are_the_keys_deepspeeds_aio_reader_returns():
    from deepspeed.runtime.swap_tensor.aio_config import get_aio_config
    assert dsk.section("aio").names == set(get_aio_config({"aio": {}}))
