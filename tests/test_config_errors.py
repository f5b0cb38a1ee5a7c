"""Bad input through `dstrain config`: exit code 2, a message naming the file, the key path and a fix,
every problem at once, and never a Python traceback."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dstrain.cli import app
from dstrain.config.layers import ENV_DEEPSPEED_CONFIG

CONFIGS = Path(__file__).parent / "configs"
DEEPSPEED = tuple(int(part) for part in importlib.metadata.version("deepspeed").split(".")[:2])


def config_fails(*args: str, env: dict[str, str | None] | None = None) -> str:
    """Run `dstrain config ARGS`, assert it failed as bad input, and return what it printed."""
    result = CliRunner().invoke(app, ["config", "--accelerator", "cpu", "--gpus", "2", *args],
                                env={ENV_DEEPSPEED_CONFIG: None, **(env or {})})
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert isinstance(result.exception, SystemExit)
    assert result.stdout == ""
    assert "Traceback" not in result.output
    assert result.stderr.startswith("error: ")
    return result.stderr


def file_fails(tmp_path: Path, text: str | bytes, name: str = "run.yaml") -> tuple[str, Path]:
    """Write a --config file, run `dstrain config --config FILE`, return (message, path)."""
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return config_fails("--config", str(path)), path


def fix_of(message: str, where: str) -> str:
    """The fix line that follows the problem reported at `where`."""
    lines = message.splitlines()
    at = next(i for i, line in enumerate(lines) if where in line)
    assert lines[at + 1].strip().startswith("fix: "), message
    return lines[at + 1].strip()[len("fix: "):]


# --------------------------------------------------------------------------- unreadable files


def test_missing_config_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    message = config_fails("--config", str(missing))
    assert f"--config {missing}: file not found" in message
    assert "check the path" in fix_of(message, "file not found")


def test_directory_given_as_config_file(tmp_path):
    message = config_fails("--config", str(tmp_path))
    assert f"--config {tmp_path}: is a directory" in message
    assert ".yaml or .json" in fix_of(message, "is a directory")


def test_unreadable_config_file():
    folder = Path(tempfile.mkdtemp(prefix="dstrain-unreadable-"))
    try:
        folder.chmod(0o755)
        path = folder / "secret.yaml"
        path.write_text("train:\n  lr: 0.1\n")
        path.chmod(0)
        message = config_fails("--config", str(path)) if os.geteuid() else _as_nobody(config_fails, "--config", str(path))
        assert "cannot read" in message and "permissions" in message
    finally:
        shutil.rmtree(folder)


def _as_nobody(check, *args: str) -> str:
    """Root reads any file, so run `check` in a forked child whose effective user is nobody. The parent
    runs it once first (on a missing file) so that every module it needs is imported already: nobody
    may not be able to read this Python's files."""
    config_fails("--config", "/nonexistent/dstrain.yaml")
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest machinery beyond this call
        code = 1
        try:
            os.seteuid(65534)
            os.write(write_end, check(*args).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        message = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, message
    return message


def test_config_path_that_cannot_be_read(tmp_path):
    # Runs as root too (unlike a chmod 000 file): a regular file used as a directory.
    (tmp_path / "file").write_text("x: 1\n")
    path = tmp_path / "file" / "run.yaml"
    message = config_fails("--config", str(path))
    assert f"--config {path}: cannot read: Not a directory" in message
    assert "permissions" in fix_of(message, "cannot read")


def test_yaml_syntax_error_names_line_and_column():
    path = CONFIGS / "bad_syntax.yaml"
    message = config_fails("--config", str(path))
    assert f"--config {path}: YAML syntax error at line 3, column 13" in message
    assert "indentation" in fix_of(message, "YAML syntax error")


def test_json_syntax_error_names_line_and_column():
    path = CONFIGS / "bad_syntax.json"
    message = config_fails("--config", str(path))
    assert f"--config {path}: JSON syntax error at line 1, column 22" in message
    assert "trailing comma" in fix_of(message, "JSON syntax error")


def test_empty_config_file():
    path = CONFIGS / "empty.yaml"
    message = config_fails("--config", str(path))
    assert f"--config {path}: file is empty" in message
    assert "max_steps" in fix_of(message, "file is empty")


def test_config_file_of_only_comments(tmp_path):
    message, path = file_fails(tmp_path, "# train:\n#   lr: 0.1\n")
    assert f"--config {path}: file holds no settings" in message


def test_yaml_list_at_the_root():
    path = CONFIGS / "list_root.yaml"
    message = config_fails("--config", str(path))
    assert f"--config {path}: the top level must be a mapping of keys to values, not a list" in message
    assert "key: value" in fix_of(message, "top level")


def test_json_scalar_at_the_root(tmp_path):
    message, _ = file_fails(tmp_path, "42", "run.json")
    assert "the top level must be a mapping of keys to values, not a number" in message


def test_binary_garbage():
    path = CONFIGS / "garbage.bin"
    message = config_fails("--config", str(path))
    assert f"--config {path}: not UTF-8 text (byte 0 is 0x89); is it a binary file?" in message
    assert "YAML or JSON" in fix_of(message, "not UTF-8")


def test_text_with_nul_bytes(tmp_path):
    message, _ = file_fails(tmp_path, b"train:\n  lr: 0.1\x00\n")
    assert "contains NUL bytes" in message


def test_utf8_bom_is_accepted(tmp_path):
    # Windows editors write one; json.loads used to reject the file as a syntax error.
    path = tmp_path / "run.json"
    path.write_bytes(b'\xef\xbb\xbf{"train": {"max_steps": 5}}')
    result = CliRunner().invoke(app, ["config", "--config", str(path), "--accelerator", "cpu", "--gpus", "1"],
                                env={ENV_DEEPSPEED_CONFIG: None})
    assert result.exit_code == 0, result.output
    assert "max_steps: 5" in result.stdout


# --------------------------------------------------------------------------- unknown keys


def test_unknown_train_key_suggests_the_right_one(tmp_path):
    message, path = file_fails(tmp_path, "train:\n  lrr: 0.001\n")
    assert f"--config {path}: train.lrr: unknown key" in message
    fix = fix_of(message, "train.lrr")
    assert fix.startswith("did you mean 'lr'?") and "valid keys: train.max_steps" in fix


def test_unknown_top_level_key_suggests_the_right_one(tmp_path):
    message, path = file_fails(tmp_path, "trian:\n  lr: 0.001\n")
    assert f"--config {path}: trian: unknown key" in message
    assert fix_of(message, "trian").startswith("did you mean 'train'?")


def test_unknown_model_key_suggests_the_right_one(tmp_path):
    message, _ = file_fails(tmp_path, "model:\n  n_layers: 2\n")
    assert fix_of(message, "model.n_layers").startswith("did you mean 'n_layer'?")


def test_unknown_deepspeed_key_names_the_file_and_suggests_the_right_one(tmp_path):
    # The file used to be missing from this message: the misspelt key is a section with only leaves set.
    message, path = file_fails(tmp_path, "deepspeed:\n  zero_optimisation:\n    stage: 2\n")
    assert f"--config {path}: deepspeed.zero_optimisation: unknown DeepSpeed key" in message
    assert fix_of(message, "zero_optimisation") == "did you mean 'zero_optimization'?"


def test_unknown_zero_key_suggests_the_right_one():
    path = CONFIGS / "unknown_keys.yaml"
    message = config_fails("--config", str(path))
    assert f"--config {path}: deepspeed.zero_optimization.stage3_prefetch_bucket: unknown ZeRO key" in message
    assert fix_of(message, "stage3_prefetch_bucket:") == "did you mean 'stage3_prefetch_bucket_size'?"


def test_unknown_offload_key_suggests_the_right_one():
    path = CONFIGS / "unknown_keys.yaml"
    message = config_fails("--config", str(path))
    assert f"--config {path}: deepspeed.zero_optimization.offload_optimizer.devcie: unknown offload key" in message
    assert fix_of(message, "devcie") == "did you mean 'device'?"


def test_unknown_key_from_set_names_the_set_layer():
    message = config_fails("--set", "train.lrr=0.1")
    assert "--set: train.lrr: unknown key" in message


# --------------------------------------------------------------------------- wrong values


def test_wrong_type_names_the_key_and_what_it_means(tmp_path):
    message, path = file_fails(tmp_path, "train:\n  max_steps: many\n")
    assert f"--config {path}: train.max_steps: Input should be a valid integer" in message
    assert "(got 'many')" in message
    assert fix_of(message, "train.max_steps") == "Optimizer steps to train for."


def test_section_that_is_not_a_mapping(tmp_path):
    message, path = file_fails(tmp_path, "deepspeed:\n  zero_optimization: 5\n")
    assert f"--config {path}: deepspeed.zero_optimization: must be a mapping" in message
    assert "stage: 2" in fix_of(message, "zero_optimization")


@pytest.mark.parametrize(("text", "where", "says"), [
    ("train:\n  micro_batch_size: -4\n", "train.micro_batch_size", "greater than 0 (got -4)"),
    ("train:\n  lr: -0.1\n", "train.lr", "greater than or equal to 0 (got -0.1)"),
    ("train:\n  warmup_steps: -1\n", "train.warmup_steps", "greater than or equal to 0"),
    ("train:\n  weight_decay: -0.5\n", "train.weight_decay", "greater than or equal to 0"),
    ("model:\n  dropout: 1.5\n", "model.dropout", "less than 1"),
    ("train:\n  betas: [0.9, 1.5]\n", "train.betas.1", "less than 1"),
    ("deepspeed:\n  gradient_clipping: -1.0\n", "deepspeed.gradient_clipping", "greater than or equal to 0"),
    ("deepspeed:\n  optimizer:\n    type: AdamW\n    params:\n      lr: -1\n", "deepspeed.optimizer.params.lr",
     "greater than or equal to 0"),
    ("deepspeed:\n  zero_optimization:\n    stage: 2\n    reduce_bucket_size: -1\n",
     # DeepSpeed 0.19 requires a reduce bucket > 0, 0.18 >= 0: dstrain says what this DeepSpeed requires
     "deepspeed.zero_optimization.reduce_bucket_size",
     "must be positive (got -1)" if DEEPSPEED >= (0, 19) else "must be at least 0 (got -1)"),
    ("deepspeed:\n  zero_optimization:\n    stage: 3\n    stage3_max_live_parameters: -1\n",
     "deepspeed.zero_optimization.stage3_max_live_parameters", "must be at least 0 (got -1)"),
], ids=lambda v: v if isinstance(v, str) and "\n" not in v and "." in v else None)
def test_negative_sizes_and_rates_are_rejected_where_they_were_written(tmp_path, text, where, says):
    message, path = file_fails(tmp_path, text)
    line = next(line for line in message.splitlines() if f"{path}: {where}:" in line)
    assert says in line
    assert fix_of(message, f"{path}: {where}:")


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
def test_non_finite_rates_are_rejected(tmp_path, value):
    message, path = file_fails(tmp_path, f"train:\n  grad_clip: {value}\n")
    assert f"--config {path}: train.grad_clip: Input should be a finite number" in message


def test_non_finite_deepspeed_value_is_rejected_instead_of_printing_invalid_json(tmp_path):
    message, path = file_fails(tmp_path, "deepspeed:\n  zero_optimization:\n    stage: 2\n"
                                         "    reduce_bucket_size: .nan\n")
    assert f"--config {path}: deepspeed.zero_optimization.reduce_bucket_size: must be a finite number" in message


def test_fp16_and_bf16_both_enabled(tmp_path):
    message, path = file_fails(tmp_path, "deepspeed:\n  fp16:\n    enabled: true\n  bf16:\n    enabled: true\n")
    assert (f"--config {path}: deepspeed.fp16.enabled and --config {path}: deepspeed.bf16.enabled: "
            "fp16 and bf16 are both enabled") in message
    assert "train.precision=" in fix_of(message, "both enabled")


def test_nvme_offload_without_a_path(tmp_path):
    message, path = file_fails(tmp_path, "deepspeed:\n  zero_optimization:\n    stage: 3\n"
                                         "    offload_optimizer:\n      device: nvme\n")
    assert f"--config {path}: deepspeed.zero_optimization.offload_optimizer.nvme_path: NVMe offload needs a path" \
        in message
    assert fix_of(message, "NVMe") == \
        "--set deepspeed.zero_optimization.offload_optimizer.nvme_path=/local_nvme/dstrain"


def test_nvme_preset_with_its_path_cleared():
    message = config_fails("--preset", "stage3_nvme", "--set", "deepspeed.zero_optimization.offload_param.nvme_path=")
    assert "deepspeed.zero_optimization.offload_param.nvme_path: NVMe offload needs a path" in message


def test_offload_param_below_stage_3_is_a_warning_because_deepspeed_ignores_it(tmp_path):
    """DeepSpeed reads offload_param at stage 3 only and runs such a file: dstrain runs it too, and says so."""
    path = tmp_path / "run.yaml"
    path.write_text("deepspeed:\n  zero_optimization:\n    stage: 2\n    offload_param:\n      device: cpu\n")
    result = CliRunner().invoke(app, ["config", "--accelerator", "cpu", "--gpus", "2", "--config", str(path)],
                                env={ENV_DEEPSPEED_CONFIG: None})
    assert result.exit_code == 0, result.output
    assert f"--config {path}: deepspeed.zero_optimization.offload_param: DeepSpeed ignores it at stage 2; " \
           "use stage 3 to offload parameters" in result.stderr


def test_a_value_of_the_wrong_type_for_deepspeeds_model_is_refused_by_config_naming_file_and_key(tmp_path):
    """DeepSpeed's DeepSpeedFP16Config wants an integer min_loss_scale: `config` says so, as `run` would."""
    message, path = file_fails(tmp_path, "deepspeed:\n  fp16:\n    enabled: false\n    min_loss_scale: 0.05\n")
    assert f"--config {path}: deepspeed.fp16.min_loss_scale: Input should be a valid integer" in message
    assert "DeepSpeedFP16Config" in message
    assert "DeepSpeed's default is 1" in fix_of(message, "min_loss_scale")


def test_offload_device_that_does_not_exist(tmp_path):
    message, _ = file_fails(tmp_path, "deepspeed:\n  zero_optimization:\n    stage: 2\n"
                                      "    offload_optimizer:\n      device: gpu\n")
    assert "device must be none, cpu or nvme (got 'gpu')" in message


def test_zero_stage_out_of_range():
    message = config_fails("--set", "deepspeed.zero_optimization.stage=4")
    assert "--set: deepspeed.zero_optimization.stage: ZeRO stage must be 0, 1, 2 or 3 (got 4)" in message


def test_auto_that_dstrain_cannot_fill_in():
    message = config_fails("--set", "deepspeed.steps_per_print=auto")
    assert "--set: deepspeed.steps_per_print: dstrain cannot fill in 'auto' for this key" in message


# --------------------------------------------------------------------------- presets, env var, --set


def test_unknown_preset_lists_the_valid_ones():
    message = config_fails("--preset", "stage4")
    assert "--preset: unknown preset 'stage4'; did you mean" in message
    assert fix_of(message, "unknown preset").startswith("choose one of: stage1, stage2, stage3, stage2_offload")


def test_unknown_preset_named_in_a_config_file(tmp_path):
    message, path = file_fails(tmp_path, "preset: stage9\n")
    assert f"--config {path}: preset: unknown preset 'stage9'" in message


def test_preset_in_a_config_file_that_is_not_a_name(tmp_path):
    message, path = file_fails(tmp_path, "preset: [stage1]\n")
    assert f"--config {path}: preset: must be a preset name" in message


def test_env_deepspeed_config_pointing_at_a_missing_file(tmp_path):
    missing = tmp_path / "ds.json"
    message = config_fails(env={ENV_DEEPSPEED_CONFIG: str(missing)})
    assert f"{ENV_DEEPSPEED_CONFIG} {missing}: file not found" in message
    assert fix_of(message, "file not found")


def test_env_deepspeed_config_with_a_json_syntax_error(tmp_path):
    # Not even DeepSpeed's lenient reader (hjson) takes an unclosed object; a trailing comma it takes
    # (test_config_realworld.py), so bad_syntax.json is no longer an error there.
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 8\n')
    message = config_fails(env={ENV_DEEPSPEED_CONFIG: str(path)})
    assert f"{ENV_DEEPSPEED_CONFIG} {path}: JSON syntax error" in message


def test_env_deepspeed_config_with_an_unknown_key_names_the_variable(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimisation": {"stage": 2}}')
    message = config_fails(env={ENV_DEEPSPEED_CONFIG: str(path)})
    assert f"{ENV_DEEPSPEED_CONFIG} ({path}): deepspeed.zero_optimisation: unknown DeepSpeed key" in message


@pytest.mark.parametrize("item", ["train.lr", "=3", "train..lr=1", ".lr=1", " =1"])
def test_malformed_set(item):
    message = config_fails("--set", item)
    assert f"--set {item!r}: expected KEY.PATH=VALUE" in message
    assert fix_of(message, "expected KEY.PATH=VALUE") == "e.g. --set train.max_steps=100"


def test_every_malformed_set_is_reported_at_once():
    message = config_fails("--set", "a", "--set", "b")
    assert message.startswith("error: 2 problems:")


@pytest.mark.parametrize("option", [["--gpus", "0"], ["--nodes", "0"]])
def test_world_size_below_one(option):
    assert "must be at least 1" in config_fails(*option)


def test_several_problems_in_one_file_are_all_reported_at_once():
    path = CONFIGS / "several_problems.yaml"
    message = config_fails("--config", str(path))
    assert message.startswith("error: 4 problems:")
    for where in ("train.lrr", "train.micro_batch_size", "deepspeed.zero_optimisation", "deepspeed.gradient_clipping"):
        assert f"--config {path}: {where}:" in message
    assert message.count("fix: ") == 4


def test_problems_in_several_layers_are_all_reported_at_once(tmp_path):
    missing = tmp_path / "ds.json"
    message = config_fails("--preset", "stage9", "--config", str(tmp_path / "none.yaml"), "--set", "oops",
                           env={ENV_DEEPSPEED_CONFIG: str(missing)})
    assert message.startswith("error: 4 problems:")


# --------------------------------------------------------------------------- regressions: these crashed


def test_message_with_square_brackets_is_printed_not_read_as_markup(tmp_path):
    # rich read '[/x]' in the message as a closing tag and raised MarkupError with a traceback.
    message, _ = file_fails(tmp_path, 'train:\n  "[/x]": 1\n')
    assert "train.[/x]: unknown key" in message


@pytest.mark.parametrize("text", ["deepspeed:\n  1: 2\n",
                                  "deepspeed:\n  zero_optimization:\n    stage: 2\n    yes: 1\n",
                                  "model:\n  kwargs:\n    null: 1\n"])
def test_keys_that_are_not_strings(tmp_path, text):
    # An int key reached difflib's suggestion and raised TypeError.
    message, path = file_fails(tmp_path, text)
    assert f"--config {path}:" in message and "keys must be strings" in message
    assert "quote the key" in fix_of(message, "keys must be strings")


@pytest.mark.parametrize(("text", "where"), [
    ("deepspeed:\n  optimizer: adam\n", "deepspeed.optimizer"),
    ("deepspeed:\n  optimizer:\n    type: AdamW\n    params: [1]\n", "deepspeed.optimizer.params"),
    ("deepspeed:\n  scheduler: WarmupLR\n", "deepspeed.scheduler"),
])
def test_optimizer_or_scheduler_that_is_not_a_mapping(tmp_path, text, where):
    # Each raised AttributeError while rendering the DeepSpeed JSON.
    message, path = file_fails(tmp_path, text)
    assert f"--config {path}: {where}: must be a mapping" in message


@pytest.mark.parametrize(("text", "where"), [
    ("deepspeed:\n  wandb:\n    group: !!binary aGVsbG8=\n", "deepspeed.wandb.group"),
    ("deepspeed:\n  wandb:\n    group: !!set {a, b}\n", "deepspeed.wandb.group"),
])
def test_yaml_values_that_json_cannot_hold(tmp_path, text, where):
    # They resolved, then json.dumps raised TypeError when printing --deepspeed-json.
    message, path = file_fails(tmp_path, text)
    assert f"--config {path}: {where}: unsupported value" in message


def test_numbers_too_long_to_read(tmp_path):
    # int() refuses more than 4300 digits: json and yaml raised ValueError.
    message, path = file_fails(tmp_path, '{"train": {"max_steps": ' + "9" * 5000 + "}}", "run.json")
    assert f"--config {path}: cannot read a value" in message


def test_numbers_beyond_64_bits(tmp_path):
    message, path = file_fails(tmp_path, "train:\n  max_steps: " + "9" * 40 + "\n")
    assert f"--config {path}: train.max_steps: number too large" in message


def test_set_of_a_number_too_long_to_read():
    message = config_fails("--set", "train.max_steps=" + "9" * 5000)
    assert "--set: train.max_steps:" in message


def test_nesting_too_deep(tmp_path):
    # deepcopy/merge/flatten ran out of stack on a file json.loads could still read.
    message, path = file_fails(tmp_path, '{"model": {"kwargs": {"x": ' + "[" * 900 + "]" * 900 + "}}}", "run.json")
    assert f"--config {path}: model.kwargs.x" in message and "nested more than" in message


def test_train_section_that_is_not_a_mapping_is_reported_even_when_a_deepspeed_key_links_to_it(tmp_path):
    # Linking gradient_clipping used to replace `train: [1]` with {grad_clip: ...}: silently accepted.
    message, path = file_fails(tmp_path, "train: [1]\ndeepspeed:\n  gradient_clipping: 2\n")
    assert f"--config {path}: train: Input should be a valid dictionary" in message


def test_yaml_aliases_expanding_into_billions_of_values(tmp_path):
    # "Billion laughs": 9 levels of 9 aliases are 387 million values from a 1 KB file.
    lines = ['l0: &l0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, 9)]
    text = "model:\n  kwargs:\n" + "".join(f"    {line}\n" for line in lines)
    message, path = file_fails(tmp_path, text)
    assert f"--config {path}: more than 100,000 values" in message


def test_unknown_preset_in_the_presets_command():
    result = CliRunner().invoke(app, ["presets", "stage7"])
    assert result.exit_code == 2
    assert "unknown preset 'stage7'" in result.stderr and "Traceback" not in result.output


def test_deepcompile_on_cpu_is_refused_before_anything_runs():
    message = config_fails("--preset", "stage3", "--set", "deepspeed.compile.deepcompile=true")
    assert "--set: deepspeed.compile.deepcompile: DeepCompile needs CUDA" in message
    assert fix_of(message, "DeepCompile needs CUDA") == "remove deepspeed.compile.deepcompile, or run on GPUs"


def test_gpt_shape_keys_set_for_an_hf_model_warn_that_they_are_ignored(tmp_path):
    from dstrain.config.resolve import resolve
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  name: hf:some/model\n  n_layer: 24\n  d_model: 2048\n")
    warnings = resolve(config_file=path, world_size=2, accelerator="cpu", env={}).warnings
    assert [w.split(": applies")[0] for w in warnings if "applies to the built-in GPT only" in w] == [
        f"--config {path}: model.n_layer", f"--config {path}: model.d_model"]
    assert all("its config.json" in w for w in warnings if "applies to the built-in GPT" in w)


def test_a_preset_or_default_gpt_shape_under_an_hf_model_says_nothing():
    from dstrain.config.resolve import resolve
    resolved = resolve("stage2", sets=["model.name=hf:some/model"], world_size=2, accelerator="cpu", env={})
    assert not [w for w in resolved.warnings if "built-in GPT" in w]


def test_model_kwargs_for_the_built_in_gpt_warn_that_they_are_ignored():
    from dstrain.config.resolve import resolve
    resolved = resolve(sets=["model.kwargs.n_layer=8"], world_size=2, accelerator="cpu", env={})
    assert any(w.startswith("--set: model.kwargs: ignored for the built-in GPT") for w in resolved.warnings), \
        resolved.warnings


def test_a_config_deepspeeds_whole_check_refuses_is_refused_by_config_naming_the_file(tmp_path):
    """Beyond the sections' models: DeepSpeedConfig's own sanity checks (here: a summed all-reduce under
    ZeRO-3, which DeepSpeed refuses at start), as deepspeed.initialize would run them in every rank."""
    message, path = file_fails(tmp_path, "deepspeed:\n  gradient_allreduce_op: sum\n  zero_optimization:\n"
                                         "    stage: 3\n")
    assert f"--config {path}: deepspeed: DeepSpeed refuses this config: ValueError: gradient_allreduce_op='sum' " \
           "is not supported with ZeRO stage 3" in message
