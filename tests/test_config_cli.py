"""`dstrain config` output (JSON for programs, YAML and --explain for people), secret redaction,
and a start that never imports torch or DeepSpeed."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from dstrain.cli import app
from dstrain.config.layers import ENV_DEEPSPEED_CONFIG
from dstrain.config.resolve import REDACTED, redact, resolve

CONFIGS = Path(__file__).parent / "configs"
REPO = Path(__file__).resolve().parents[1]
SECRETS = {"comet": "comet-key-1234567890", "hf": "hf_abcdefghijklmnop", "number": "987654321987"}

SECRET_CONFIG = f"""\
model:
  kwargs:
    hf_token: {SECRETS["hf"]}
data:
  tokenizer: gpt2-token-free-tokenizer
  kwargs:
    password: {SECRETS["number"]}
deepspeed:
  comet:
    enabled: true
    api_key: {SECRETS["comet"]}
"""


def config_ok(*args: str, env: dict[str, str | None] | None = None):
    result = CliRunner().invoke(app, ["config", "--accelerator", "cpu", "--gpus", "2", *args],
                                env={ENV_DEEPSPEED_CONFIG: None, "COLUMNS": "250", **(env or {})})
    assert result.exit_code == 0, (result.output, result.exception)
    return result


def _explain_rows(stdout: str) -> dict[str, tuple[str, str]]:
    """--explain's table as {key: (value, set by)}."""
    rows = {}
    for line in stdout.splitlines():
        cells = [cell.strip() for cell in line.strip("│ ").split("│")]
        if len(cells) == 3 and cells[0]:
            rows[cells[0]] = (cells[1], cells[2])
    return rows


@pytest.fixture
def secret_config(tmp_path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(SECRET_CONFIG)
    return path


# --------------------------------------------------------------------------- output


def test_deepspeed_json_prints_only_the_json_that_resolve_renders():
    result = config_ok("--preset", "stage2_offload", "--deepspeed-json")
    assert result.stdout.startswith("{") and result.stdout.endswith("}\n")
    printed = json.loads(result.stdout)
    assert printed == resolve(preset="stage2_offload", world_size=2, accelerator="cpu", env={}).ds_config


def test_deepspeed_json_is_strict_json():
    result = config_ok("--preset", "stage3", "--deepspeed-json")
    json.loads(result.stdout, parse_constant=lambda name: pytest.fail(f"non-standard JSON constant {name}"))


def test_default_output_is_the_resolved_config_as_yaml():
    result = config_ok("--preset", "stage3", "--set", "train.max_steps=7")
    data = yaml.safe_load(result.stdout)
    assert data["train"]["max_steps"] == 7
    assert data["preset"] == "stage3"
    assert data["deepspeed"]["zero_optimization"]["stage"] == 3
    assert data["deepspeed"]["train_batch_size"] == data["train"]["micro_batch_size"] * 2


def test_explain_shows_the_layer_that_set_each_key(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  max_steps: 50\n")
    rows = _explain_rows(config_ok("--preset", "stage2", "--config", str(path), "--set",
                                   "train.micro_batch_size=4", "--explain").stdout)
    assert rows["deepspeed.zero_optimization.stage"] == ("2", "preset stage2")
    assert rows["train.max_steps"] == ("50", f"--config {path}")
    assert rows["train.micro_batch_size"] == ("4", "--set")
    assert rows["train.lr"] == ("0.001", "default")
    assert rows["deepspeed.train_micro_batch_size_per_gpu"] == ("4", "follows train.micro_batch_size (--set)")
    assert rows["train.global_batch_size"] == ("8", "derived: micro 4 x accum 1 x world 2")
    assert rows["train.precision"] == ('"fp32"', "auto: fp32 on cpu")


def test_explain_names_the_env_deepspeed_config():
    hf = CONFIGS / "hf_zero3_offload.json"
    rows = _explain_rows(config_ok("--explain", env={ENV_DEEPSPEED_CONFIG: str(hf)}).stdout)
    assert rows["deepspeed.zero_optimization.stage"] == ("3", f"{ENV_DEEPSPEED_CONFIG} ({hf})")


def test_explain_attributes_the_generated_optimizer_to_dstrain():
    # The note for the generated section used to be dropped: its keys showed "default".
    rows = _explain_rows(config_ok("--explain").stdout)
    assert rows["deepspeed.optimizer.type"][1].startswith("dstrain: from train.optimizer")


def test_explain_prints_values_verbatim_even_when_they_look_like_markup():
    # rich read '[bold]' in a value as markup and dropped it from the table.
    rows = _explain_rows(config_ok("--set", "model.name=[bold]pkg.mod:fn", "--explain").stdout)
    assert rows["model.name"][0] == '"[bold]pkg.mod:fn"'


# --------------------------------------------------------------------------- secrets


@pytest.mark.parametrize("mode", [[], ["--explain"], ["--deepspeed-json"]])
def test_secrets_are_redacted_in_every_output(secret_config, mode):
    stdout = config_ok("--config", str(secret_config), *mode).stdout
    for secret in SECRETS.values():
        assert secret not in stdout
    assert REDACTED in stdout


@pytest.mark.parametrize("mode", [[], ["--explain"]])
def test_keys_that_only_contain_token_are_not_redacted(secret_config, mode):
    stdout = config_ok("--config", str(secret_config), *mode).stdout
    assert "gpt2-token-free-tokenizer" in stdout
    assert "uint16" in stdout  # data.token_dtype


def test_redacted_values_are_kept_for_the_run_itself(secret_config):
    resolved = resolve(config_file=secret_config, env={})
    assert resolved.ds_config["comet"]["api_key"] == SECRETS["comet"]


@pytest.mark.parametrize("key", ["api_key", "apikey", "API_KEY", "apiKey", "token", "hf_token", "access_token",
                                 "password", "db_password", "secret", "client_secret"])
def test_secret_key_names_are_redacted(key):
    assert redact({"a": {key: "s3cr3t"}}) == {"a": {key: REDACTED}}


@pytest.mark.parametrize("key", ["tokenizer", "token_dtype", "max_tokens", "tokens_per_step", "secretary",
                                 "password_hint_shown"])
def test_keys_that_merely_contain_a_secret_word_are_kept(key):
    assert redact({key: "visible"}) == {key: "visible"}


def test_numeric_secrets_are_redacted():
    # Only strings used to be redacted: an unquoted numeric token was printed.
    assert redact({"token": 123456789, "api_key": 1.5}) == {"token": REDACTED, "api_key": REDACTED}


@pytest.mark.parametrize("value", [None, "", False, True])
def test_empty_secret_fields_stay_as_they_are(value):
    assert redact({"api_key": value}) == {"api_key": value}


def test_secrets_inside_lists_are_redacted():
    assert redact({"hosts": [{"password": "pw"}]}) == {"hosts": [{"password": REDACTED}]}


# --------------------------------------------------------------------------- startup

STARTUP_PROBE = textwrap.dedent("""
    import json, sys
    import dstrain.cli
    from typer.testing import CliRunner
    runner = CliRunner()
    codes = [runner.invoke(dstrain.cli.app, args, env={"PL_DEEPSPEED_CONFIG_PATH": None}).exit_code for args in (
        ["presets"], ["presets", "stage3"], ["--help"], ["run", "--help"],
    )]
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "deepspeed"))
    codes += [runner.invoke(dstrain.cli.app, args, env={"PL_DEEPSPEED_CONFIG_PATH": None}).exit_code for args in (
        ["config", "--preset", "stage3_offload", "--accelerator", "cpu", "--gpus", "2"],
        ["config", "--preset", "stage2", "--explain", "--accelerator", "cpu", "--gpus", "2"],
        ["config", "--preset", "stage2", "--deepspeed-json"],
        ["config", "--preset", "no-such-preset"],
    )]
    print(json.dumps({"codes": codes, "heavy": heavy}))
""")


@pytest.mark.slow
def test_presets_and_help_never_import_torch_or_deepspeed():
    """`config` may (DeepSpeed's own config models give its verdict, issue 38); presets and --help may not."""
    out = subprocess.run([sys.executable, "-c", STARTUP_PROBE], capture_output=True, text=True, cwd=REPO,
                         timeout=60, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["codes"] == [0, 0, 0, 0, 0, 0, 0, 2]
    assert report["heavy"] == []


def test_bad_input_in_a_real_process_exits_2_without_a_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "dstrain.cli", "config", "--config", str(tmp_path / "no.yaml")],
                          capture_output=True, text=True, cwd=REPO, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "COLUMNS": "200"})
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "file not found" in proc.stderr and "Traceback" not in proc.stderr
