"""Property: whatever file a user hands to dstrain, it either resolves into a strict, explicit DeepSpeed
JSON or fails with UserError and a message; never any other exception.

Generated configs mix the real key names (schema and DeepSpeed) with random ones, nest at random,
take random values (ints, floats with nan/inf/negatives, strings, None, lists, bools, "auto"), and
are written as YAML, JSON, mangled text or binary garbage."""

from __future__ import annotations

import contextlib
import io
import json
import math
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from dstrain.config import show
from dstrain.cli import app
from dstrain.config import deepspeed_keys as dsk
from dstrain.config.layers import ENV_DEEPSPEED_CONFIG
from dstrain.config.presets import available
from dstrain.config.resolve import AUTO, ResolvedConfig, resolve
from dstrain.config.schema import DataConfig, ModelConfig, RunConfig, TrainConfig
from dstrain.errors import UserError

SECTIONS = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig}
ZERO_KEYS = sorted(dsk.zero_keys("").names) if dsk.zero_keys("") else ["stage", "reduce_bucket_size", "sub_group_size"]
OFFLOAD_KEYS = sorted(dsk.zero_keys("offload_param").names | dsk.zero_keys("offload_optimizer").names) \
    if dsk.zero_keys("offload_param") else ["device", "nvme_path", "pin_memory"]
REAL_KEYS = sorted({*RunConfig.model_fields, *(f for m in SECTIONS.values() for f in m.model_fields),
                    *dsk.TOP_LEVEL_KEYS, *ZERO_KEYS, *OFFLOAD_KEYS,
                    "enabled", "type", "params", "lr", "betas", "eps", "weight_decay", "api_key", "token",
                    "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps", "cpu_offload",
                    "partition_activations", "cpu_checkpointing"})
WORDS = ["auto", "cpu", "nvme", "none", "bf16", "fp16", "fp32", "adamw", "cosine", "gpt", "corpus", "AdamW",
         "WarmupLR", "/tmp/dstrain-nvme", "", "stage2", "Stage3-Offload", "[/x]", "[bold]", "1e9", "yes", "null"]

# --------------------------------------------------------------------------- strategies

keys = st.one_of(st.sampled_from(REAL_KEYS), st.text(max_size=8))
odd_keys = st.one_of(keys, keys, keys, st.integers(-3, 3), st.booleans(), st.none())  # YAML's 1:, yes:, null:
scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(-10, 100), st.integers(), st.sampled_from([0, 1, 2, 3, 8, 64, 10**9, 2**63, -(2**63)]),
    st.floats(), st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e-8, 0.5, 1e300]),
    st.text(max_size=10), st.sampled_from(WORDS),
)
anything = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(odd_keys, children, max_size=3),
    max_leaves=6,
)


def _mapping(names, values, max_size: int) -> st.SearchStrategy[dict]:
    """Mostly real key names, sometimes a random one (a typo, or a key from another section)."""
    return st.dictionaries(st.sampled_from(sorted(names)) | keys, values, max_size=max_size)


# Values a real section often holds, so that a good share of the generated configs resolve.
PLAUSIBLE = st.sampled_from([1, 2, 4, 8, 64, 256, 0.001, 0.1, 0.5, True, False, "bf16", "fp16", "fp32", "auto",
                             "adamw", "cosine", "constant", "gpt", "synthetic", "byte", [0.9, 0.99], {}])


def _section(model) -> st.SearchStrategy[dict]:
    return _mapping(model.model_fields, PLAUSIBLE | PLAUSIBLE | scalars | anything, 4)


offload = _mapping(OFFLOAD_KEYS, st.sampled_from(["cpu", "nvme", "none", "/tmp/x", True, 4]) | scalars, 3)
zero = _mapping(ZERO_KEYS, st.sampled_from([0, 1, 2, 3, AUTO, 5e8, True]) | scalars | offload, 5)
deepspeed = _mapping(dsk.TOP_LEVEL_KEYS, st.one_of(
    scalars, st.sampled_from([AUTO, 1, 8, 1.0]), zero,
    _mapping(["enabled", "type", "params", "api_key"], scalars | anything, 3), anything), 5)

def _mostly(strategy: st.SearchStrategy) -> st.SearchStrategy:
    """`strategy` three times in four, anything at all otherwise."""
    return st.one_of(strategy, strategy, strategy, anything)


run_config = st.fixed_dictionaries({}, optional={
    "model": _mostly(_section(ModelConfig)), "data": _mostly(_section(DataConfig)),
    "train": _mostly(_section(TrainConfig)), "deepspeed": _mostly(deepspeed),
    "preset": _mostly(st.sampled_from(available())) | st.none() | st.sampled_from(WORDS),
    "extra": anything,  # renamed below to a random (often invalid) top-level key
})


@st.composite
def run_configs(draw) -> dict:
    data = draw(run_config)
    if "extra" in data and draw(st.integers(0, 3)) == 0:
        data[draw(odd_keys)] = data.pop("extra")
    data.pop("extra", None)
    return data


def _yaml(data: Any) -> bytes:
    return yaml.safe_dump(data, allow_unicode=True, sort_keys=False).encode()


def _json(data: Any) -> bytes:
    # NaN/Infinity included: Python's json reads them back; non-str keys become strings as in real JSON.
    return json.dumps(data).encode()


@st.composite
def config_files(draw, data=run_configs()) -> tuple[str, bytes]:
    """(file suffix, bytes): a generated config written the ways users write, or break, them."""
    how = draw(st.sampled_from(["yaml", "yaml", "json", "json-as-yaml", "mangled", "binary", "root-not-mapping"]))
    if how == "binary":
        return draw(st.sampled_from([".yaml", ".json", ".bin"])), draw(st.binary(max_size=100))
    if how == "root-not-mapping":
        return ".yaml", _yaml(draw(anything))
    value = draw(data)
    if how == "yaml":
        return ".yaml", _yaml(value)
    if how in ("json", "json-as-yaml"):
        return (".json" if how == "json" else ".yml"), _json(value)
    text = _yaml(value).decode()
    cut = draw(st.integers(0, len(text)))
    insert = draw(st.sampled_from(["\t", ":", "- ", "{", '"', "[", "\x00", "\ufeff", "  "]) | st.text(max_size=3))
    return draw(st.sampled_from([".yaml", ".json"])), (text[:cut] + insert + text[cut:]).encode()


set_items = st.lists(st.one_of(
    st.builds(lambda k, v: f"{k}={v}",
              st.sampled_from(["train.lr", "train.micro_batch_size", "train.global_batch_size", "model.d_model",
                               "deepspeed.zero_optimization.stage", "deepspeed.train_batch_size",
                               "deepspeed.zero_optimization.offload_param.device", "deepspeed.fp16.enabled",
                               "preset", "train"]),
              st.sampled_from(["1", "0", "-1", "3", "auto", "true", "nan", "inf", "1e9", "[1, 2]", "{a: 1}", "",
                               "x", "2024-01-01", "!!binary aGk="])),
    st.text(max_size=10)), max_size=2)


# --------------------------------------------------------------------------- checks


# Module scope, not tmp_path: hypothesis runs every example inside one call of the test function.
@pytest.fixture(scope="module")
def workdir() -> Path:
    with tempfile.TemporaryDirectory(prefix="dstrain-fuzz-") as name:
        yield Path(name)


def _leaves(node: Any) -> list[Any]:
    if isinstance(node, dict):
        return [leaf for value in node.values() for leaf in _leaves(value)]
    if isinstance(node, list):
        return [leaf for value in node for leaf in _leaves(value)]
    return [node]


def _check_resolved(resolved: ResolvedConfig) -> None:
    """What a successful resolution promises: explicit, strict JSON with consistent batch arithmetic."""
    ds = resolved.ds_config
    assert json.loads(json.dumps(ds, allow_nan=False)) == ds
    assert AUTO not in _leaves(ds)
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size"):
        assert type(ds[key]) is int and ds[key] > 0
    assert ds["train_batch_size"] == (ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"]
                                      * resolved.world_size)
    assert (ds.get("zero_optimization") or {}).get("stage", 0) in (0, 1, 2, 3)
    # What `dstrain config` prints (the rich --explain table is left to the slower CLI property).
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        for as_json in (False, True):
            show.resolved_config(resolved, explain=False, deepspeed_json=as_json)


def _strict_json(text: str) -> Any:
    """json.loads that refuses NaN and Infinity, which Python writes but JSON does not have."""
    def refuse(name: str) -> None:
        raise AssertionError(f"non-standard JSON constant {name}")
    return json.loads(text, parse_constant=refuse)


def _check_user_error(err: UserError) -> None:
    assert err.problems, "a UserError without problems"
    for problem in err.problems:
        assert problem.message.strip()
    assert str(err).strip()


@settings(max_examples=1000, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(file=config_files(), sets=st.just([]) | set_items, world=st.integers(1, 16),
       accelerator=st.sampled_from(["cuda", "cpu"]),
       env_file=st.none() | st.none() | st.none() | config_files(deepspeed | anything))
@pytest.mark.slow
def test_any_config_file_resolves_or_raises_a_user_error(workdir, file, sets, world, accelerator, env_file):
    suffix, content = file
    path = workdir / f"run{suffix}"
    path.write_bytes(content)
    env = {}
    if env_file is not None:
        env_path = workdir / f"ds{env_file[0]}"
        env_path.write_bytes(env_file[1])
        env[ENV_DEEPSPEED_CONFIG] = str(env_path)
    try:
        resolved = resolve(config_file=path, sets=sets, world_size=world, accelerator=accelerator, env=env)
    except UserError as err:
        event("UserError")
        _check_user_error(err)
    else:
        event("resolved")
        _check_resolved(resolved)


@settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=run_configs().map(lambda d: {k: v for k, v in d.items() if k in ("model", "data", "train", "deepspeed")}),
       world=st.integers(1, 8), preset=st.none() | st.sampled_from(available()))
@pytest.mark.slow
def test_well_formed_yaml_with_real_sections_resolves_or_raises_a_user_error(workdir, data, world, preset):
    path = workdir / "real.yaml"
    path.write_bytes(_yaml(data))
    try:
        resolved = resolve(preset=preset, config_file=path, world_size=world, accelerator="cuda", env={})
    except UserError as err:
        event("UserError")
        _check_user_error(err)
    else:
        event("resolved")
        _check_resolved(resolved)


@settings(max_examples=50, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(file=config_files(), mode=st.sampled_from([[], ["--explain"], ["--deepspeed-json"]]))
def test_any_config_file_through_the_cli_exits_0_or_2_without_a_traceback(workdir, file, mode):
    suffix, content = file
    path = workdir / f"cli{suffix}"
    path.write_bytes(content)
    result = CliRunner().invoke(app, ["config", "--config", str(path), "--gpus", "2", "--accelerator", "cpu", *mode],
                                env={ENV_DEEPSPEED_CONFIG: None})
    assert result.exit_code in (0, 2), (result.exit_code, result.exception, result.output)
    assert "Traceback" not in result.output
    if result.exit_code == 2:
        assert result.stderr.startswith("error: ") and result.stdout == ""
    elif mode == ["--deepspeed-json"]:
        _strict_json(result.stdout)
