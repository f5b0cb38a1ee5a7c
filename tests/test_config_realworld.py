"""Real DeepSpeed JSONs from public projects (tests/configs/realworld/, origins in SOURCES.md) through
PL_DEEPSPEED_CONFIG_PATH: every file DeepSpeed accepts resolves to an explicit config (no "auto" left,
consistent batch arithmetic); every file DeepSpeed refuses is refused by dstrain before any rank starts,
with its own message. Resolution is in-process and fast; the training sample is the one integration
test at the end (one file per ZeRO stage and offload kind, 2 steps on 2 CPU ranks)."""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

import pytest

from dstrain.config.files import read_deepspeed_json
from dstrain.config.layers import ENV_DEEPSPEED_CONFIG
from dstrain.config.resolve import resolve
from dstrain.errors import UserError
from launcher import TINY, assert_ok, cpu_ranks_support_fp16, dstrain, losses

DEEPSPEED = tuple(int(part) for part in metadata.version("deepspeed").split(".")[:2])
REALWORLD = Path(__file__).parent / "configs" / "realworld"
FILES = sorted(p.name for p in REALWORLD.glob("*.json") if p.name != "deepspeed_verdicts.json")
# DeepSpeed 0.19.8's own verdict on every file, recorded by check_deepspeed_accepts.py --write (SOURCES.md).
VERDICTS = json.loads((REALWORLD / "deepspeed_verdicts.json").read_text())
# DeepSpeedConfig accepts it, so the checker says yes; DeepSpeed's engine refuses it when it builds the
# optimizer (ValueError on optimizer.params.max_grad_norm), which the checker does not reach.
REFUSED_BY_DEEPSPEEDS_ENGINE = {"megatron-deepspeed__curriculum_learning_ds_zero_stage_1_config_baseline.json"}

# What dstrain says, before any rank starts, for files DeepSpeed refuses.
REFUSED_BY_DEEPSPEED = {
    "axolotl__zero1_torch_compile.json": "deepspeed.compile.disable: unknown compile key",
    "axolotl__zero2_torch_compile.json": "deepspeed.compile.disable: unknown compile key",
    "chinese-llama-alpaca__scripts_ds_zero2_no_offload.json":
        "deepspeed.fp16.min_loss_scale: Input should be a valid integer",
    "transformers__docs_deepspeed_md_zero3_nvme.json":
        "deepspeed.zero_optimization.aio: unknown ZeRO key",
    "transformers__docs_main_classes_deepspeed_md_nvme.json":
        "deepspeed.zero_optimization.aio: unknown ZeRO key",
    "deepspeed__tests_model_bingbertsquad_deepspeed_bsz24_fp16_eigenvalue_quantize_config.json":
        "deepspeed.quantize_training: DeepSpeed has removed this key",
    "deepspeedexamples__training_bing_bert_deepspeed_bsz4k_progressive_layer_drop_config_seq128.json":
        "deepspeed.progressive_layer_drop: DeepSpeed has removed this key",
    "deepspeedexamples__training_bing_bert_deepspeed_bsz64k_lamb_config_seq128.json":
        "deepspeed.sparse_attention: DeepSpeed has removed this key",
    "megatron-deepspeed__curriculum_learning_ds_zero_stage_1_config_baseline.json":
        "deepspeed.optimizer.params.max_grad_norm: DeepSpeed refuses this key when it builds the engine",
    "open-assistant__deepspeed_rl.json":
        "deepspeed.gradient_accumulation_steps: must be a number, not the string '8'",
    "internvl__segmentation_zero_configs_adam_zero1_amp.json": "deepspeed.amp: DeepSpeed has removed this key",
}
# DeepSpeed 0.19 removed these files' keys; 0.18 still accepts them, and so does dstrain on it.
REMOVED_IN_0_19 = {"deepspeed__tests_model_bingbertsquad_deepspeed_bsz24_fp16_eigenvalue_quantize_config.json",
                   "deepspeedexamples__training_bing_bert_deepspeed_bsz4k_progressive_layer_drop_config_seq128.json",
                   "deepspeedexamples__training_bing_bert_deepspeed_bsz64k_lamb_config_seq128.json"}
if DEEPSPEED < (0, 19):
    for _name in REMOVED_IN_0_19:
        del REFUSED_BY_DEEPSPEED[_name]


def deepspeed_refuses(name: str) -> bool:
    """The recorded verdict (DeepSpeed 0.19.8's), less the keys 0.19 removed where 0.18 is installed."""
    if DEEPSPEED < (0, 19) and name in REMOVED_IN_0_19:
        return False
    return VERDICTS["files"][name]["accepted"] == "no" or name in REFUSED_BY_DEEPSPEEDS_ENGINE


# DeepCompile has no CPU implementation: these resolve for GPUs, and dstrain refuses them on CPU.
CUDA_ONLY = {"deepspeed__tests_torch_compile_ds_config_z3_deepcompile_no_persist.json"}


def world_for(ds: dict) -> int:
    """2 ranks, unless the file's own batch numbers were written for another world size (as
    DeepSpeed computes it: train = micro x accum x world)."""
    numbers = [ds.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")]
    train, micro, accum = (n if isinstance(n, int) else None for n in numbers)
    if train and micro:
        per_world = micro * (accum or 1)
        if accum is None and train % (2 * micro) == 0 or accum is not None and train == 2 * per_world:
            return 2
        return max(1, train // per_world)
    return 2


def resolve_file(name: str, accelerator: str | None = None):
    path = REALWORLD / name
    ds, _ = read_deepspeed_json(path, ENV_DEEPSPEED_CONFIG)
    world = world_for(ds)
    accelerator = accelerator or ("cuda" if name in CUDA_ONLY else "cpu")
    return resolve(world_size=world, accelerator=accelerator, env={ENV_DEEPSPEED_CONFIG: str(path)}), world


def test_the_corpus_has_120_files_from_25_projects_each_named_in_sources_with_deepspeeds_verdict():
    sources = (REALWORLD / "SOURCES.md").read_text()
    assert len(FILES) >= 120 and len({name.split("__")[0] for name in FILES}) >= 25
    assert [name for name in FILES if f"| {name} |" not in sources] == []
    assert sorted(VERDICTS["files"]) == FILES  # recorded for every file, none left over
    # recorded by the DeepSpeed installed here; the oldest DeepSpeed's lane reads 0.19's, less what 0.19 removed
    assert VERDICTS["deepspeed"] == metadata.version("deepspeed") or DEEPSPEED < (0, 19)


@pytest.mark.parametrize("name", FILES)
def test_dstrains_verdict_is_deepspeeds(name):
    """Accepted by DeepSpeed: resolves to an explicit, consistent config. Refused by DeepSpeed: refused by
    dstrain's resolution (what `dstrain config` and `run` both do before any rank starts), with its message."""
    try:
        resolved, world = resolve_file(name)
    except UserError as err:
        assert deepspeed_refuses(name), f"dstrain refuses what DeepSpeed accepts:\n{err}"
        assert REFUSED_BY_DEEPSPEED.get(name, "") in str(err)
        return
    assert not deepspeed_refuses(name), f"dstrain accepts what DeepSpeed refuses: {VERDICTS['files'][name]}"
    ds = resolved.ds_config
    assert '"auto"' not in json.dumps(ds)
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * world
    assert not (ds.get("fp16", {}).get("enabled") and ds.get("bf16", {}).get("enabled"))


# Files DeepSpeed accepts that cannot run on CPU ranks beyond fp16 (which any file fixing fp16 on meets):
# what pre-flight says for them, before any rank starts (`dstrain run`, --dry-run too).
CPU_REFUSED = {
    "deepspeedexamples__training_bing_bert_1-bit_lamb_nccl_deepspeed_bsz64k_onebitlamb_config_seq128_nccl.json":
        "deepspeed.optimizer.type (from PL_DEEPSPEED_CONFIG_PATH",
    "deepspeedexamples__training_bingbertsquad_1-bit_adam_nccl_deepspeed_onebitadam_bsz96_config.json":
        "the installed DeepSpeed 0.19.8 has no optimizer 'OnebitAdam'",
    "internvl__segmentation_zero_configs_adam_zero3_fp16.json": "has no optimizer 'ZeroOneAdam'",
    "llava-next__scripts_zero3pp.json": "ZeRO++ quantization needs DeepSpeed's quantizer op, which exists only for CUDA",
}


def fixes_fp16_on(name: str) -> bool:
    section = read_deepspeed_json(REALWORLD / name, ENV_DEEPSPEED_CONFIG)[0].get("fp16")
    return isinstance(section, dict) and section.get("enabled") in (True, "true")


@pytest.mark.parametrize("name", [n for n in FILES if not deepspeed_refuses(n) and n not in CUDA_ONLY])
def test_a_file_that_cannot_run_on_cpu_ranks_is_refused_by_preflight(name, monkeypatch):
    """ZeRO++ quantization and optimizers gone from DeepSpeed: refused with the key, before any rank. fp16 as
    DeepSpeed's CPU accelerator says on this machine: refused where it refuses fp16, let through where it runs it."""
    from dstrain.launcher.preflight import check_runnable
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # as `dstrain run` sets it before importing DeepSpeed
    resolved, _ = resolve_file(name)
    try:
        check_runnable(resolved)
    except UserError as err:
        message = str(err)
    else:
        message = ""
    refuses_fp16 = fixes_fp16_on(name) and not cpu_ranks_support_fp16()
    assert ("fp16 does not run on CPU ranks" in message) == refuses_fp16, message
    assert (message != "") == (refuses_fp16 or name in CPU_REFUSED), message
    assert CPU_REFUSED.get(name, "") in message


def test_every_message_named_here_belongs_to_a_file_deepspeed_refuses():
    assert [name for name in REFUSED_BY_DEEPSPEED if not deepspeed_refuses(name)] == []


def test_offload_param_below_stage_3_runs_as_deepspeed_runs_it_with_a_warning():
    """DeepSpeed reads offload_param at stage 3 only (issue 38: a refusal here was stricter than DeepSpeed)."""
    resolved, _ = resolve_file("deepspeed__tests_hybrid_engine_hybrid_engine_config.json")
    assert any("deepspeed.zero_optimization.offload_param: DeepSpeed ignores it at stage 0; use stage 3 to "
               "offload parameters" in w for w in resolved.warnings)


@pytest.mark.parametrize("name", sorted(CUDA_ONLY))
def test_a_deepcompile_file_runs_compiled_on_gpus_and_is_refused_on_cpu(name):
    resolved, _ = resolve_file(name)
    assert resolved.ds_config["compile"]["deepcompile"] is True and resolved.config.train.compile is True
    assert "leaf_module" not in resolved.ds_config["zero_optimization"]  # DeepCompile cannot trace one
    with pytest.raises(UserError) as caught:
        resolve_file(name, accelerator="cpu")
    assert "deepspeed.compile.deepcompile: DeepCompile needs CUDA" in str(caught.value)


def test_a_string_deepspeeds_models_read_is_read_as_they_read_it(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": "true"}}')
    resolved = resolve(world_size=2, accelerator="cuda", env={ENV_DEEPSPEED_CONFIG: str(path)})
    assert resolved.precision == "fp16"  # "enabled": "true", which DeepSpeed's pydantic model reads as true


def test_llamafactorys_foreign_keys_are_warnings_that_name_the_file_and_the_key():
    resolved, _ = resolve_file("llamafactory__ds_z3_fp8_config.json")
    path = REALWORLD / "llamafactory__ds_z3_fp8_config.json"
    assert [w.split(": unknown")[0] for w in resolved.warnings] == [
        f"{ENV_DEEPSPEED_CONFIG} ({path}): deepspeed.comms_config",
        f"{ENV_DEEPSPEED_CONFIG} ({path}): deepspeed.monitor_config"]
    assert all("DeepSpeed ignores it" in w for w in resolved.warnings)


def test_axolotls_zero_values_are_kept_as_written():
    resolved, _ = resolve_file("axolotl__zero3_bf16_cpuoffload_all.json")
    zero = resolved.ds_config["zero_optimization"]
    assert (zero["sub_group_size"], zero["max_live_parameters"], zero["max_reuse_distance"]) == (0, 0, 0)


# One file per ZeRO stage 2-3 placement with offload, and plain stage 3, each trained 2 steps on 2 CPU ranks by
# the real launcher. Stages 1 and 2 without offload are left to the presets' runs (tests/test_run.py): their
# files differ from the presets in values the fast tests above resolve, not in what the ranks build.
TRAINED_SAMPLE = [
    "llamafactory__ds_z2_offload_config.json",  # stage 2, optimizer on the CPU
    "llamafactory__ds_z3_config.json",  # stage 3
    "axolotl__zero3_bf16_cpuoffload_all.json",  # stage 3, parameters and optimizer on the CPU; 0 sizes
    "axolotl__zero3_bf16_cpuoffload_params.json",  # stage 3, parameters alone on the CPU
]


# CI's oldest-DeepSpeed lane trains the two offload placements (optimizer; parameters and optimizer) of the sample.
OLDEST_DEEPSPEED_SAMPLE = {"llamafactory__ds_z2_offload_config.json", "axolotl__zero3_bf16_cpuoffload_all.json"}


@pytest.mark.integration
@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.oldest_deepspeed)
                                  if name in OLDEST_DEEPSPEED_SAMPLE else name for name in TRAINED_SAMPLE])
def test_a_sample_of_the_corpus_trains_two_steps_on_two_cpu_ranks(name, tmp_path):
    sets = [*TINY, "train.max_steps=2", "train.save_checkpoints=false", "train.log_every=1",
            "train.eval_every=100", "train.precision=fp32"]
    args = ["run", "--accelerator", "cpu", "--gpus", "2", "--run-dir", str(tmp_path / "run")]
    for item in sets:
        args += ["--set", item]
    result = dstrain(*args, env={ENV_DEEPSPEED_CONFIG: str(REALWORLD / name)}, timeout=900)
    assert_ok(result)
    ds = json.loads((tmp_path / "run" / "ds_config.json").read_text())
    source = json.loads((REALWORLD / name).read_text())
    assert ds["zero_optimization"]["stage"] == source["zero_optimization"]["stage"]
    for offload in ("offload_param", "offload_optimizer"):  # where the states live survives too
        assert (ds["zero_optimization"].get(offload) or {}).get("device", "none") == \
            (source["zero_optimization"].get(offload) or {}).get("device", "none"), offload
    trained = losses(tmp_path / "run")
    assert sorted(trained) == [1, 2] and all(loss == loss and loss > 0 for loss in trained.values())


FP16_SAMPLE = "accelerate__zero_stage3_config.json"  # fp16 on, ZeRO-3


@pytest.mark.integration
def test_an_fp16_file_trains_where_the_cpu_runs_fp16_and_is_refused_before_any_rank_where_not(tmp_path):
    """Both sides of DeepSpeed's fp16 answer through the real `dstrain run` (not a dry run): on a CPU whose
    accelerator runs fp16 the published file trains 2 steps in fp16; elsewhere pre-flight refuses it with exit
    2, naming the file and the fix, before any rank starts."""
    run_dir = tmp_path / "run"
    args = ["run", "--accelerator", "cpu", "--gpus", "2", "--run-dir", str(run_dir)]
    for item in (*TINY, "train.max_steps=2", "train.save_checkpoints=false", "train.log_every=1",
                 "train.eval_every=100"):
        args += ["--set", item]
    result = dstrain(*args, env={ENV_DEEPSPEED_CONFIG: str(REALWORLD / FP16_SAMPLE)}, timeout=900)
    if cpu_ranks_support_fp16():
        assert_ok(result)
        ds = json.loads((run_dir / "ds_config.json").read_text())
        assert ds["fp16"]["enabled"] is True and ds["zero_optimization"]["stage"] == 3
        trained = losses(run_dir)
        assert trained and all(loss == loss and 0 < loss < float("inf") for loss in trained.values())
    else:
        message = " ".join(result.stderr.split())
        assert result.returncode == 2, result.stdout + result.stderr
        assert "Traceback" not in result.stdout + result.stderr
        assert f"train.precision (from {ENV_DEEPSPEED_CONFIG} ({REALWORLD / FP16_SAMPLE})" in message, message
        assert "fp16 does not run on CPU ranks" in message and "set train.precision=bf16" in message, message
        assert not run_dir.exists()  # refused before the run directory, and so before any rank
