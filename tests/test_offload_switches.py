"""The `speedups:` section's switches: the DSTRAIN_<KEY> environment layer (dstrain/config/layers.py: off,
on, or a number for tuning, resolved by the `dstrain` command into the config the ranks read) and the
registry's use of them (fast lane)."""

from __future__ import annotations

import pytest

from dstrain.config.resolve import resolve
from dstrain.errors import UserError


def speedups(env: dict, *sets: str):
    return resolve(None, None, list(sets), world_size=1, accelerator="cpu", env=env).config.speedups


def test_a_speedup_switch_reads_off_on_and_a_number():
    assert speedups({}).offload_overlap is True and speedups({}).offload_overlap_threads == 0  # unset: the default
    for off in ("0", "off", " No ", "false"):
        assert speedups({"DSTRAIN_OFFLOAD_OVERLAP": off}).offload_overlap is False
    for on in ("1", "on", "yes"):
        assert speedups({"DSTRAIN_OFFLOAD_OVERLAP": on}).offload_overlap is True
    tuned = speedups({"DSTRAIN_OFFLOAD_OVERLAP": "8", "DSTRAIN_OFFLOAD_CHUNKS": "4096"})
    assert (tuned.offload_overlap, tuned.offload_overlap_threads) == (True, 8)
    assert (tuned.offload_chunks, tuned.offload_chunk_elements) == (True, 4096)


def test_the_gradient_copy_switch_reads_bf16_fp32_and_off():
    assert speedups({}).offload_grads == speedups({"DSTRAIN_OFFLOAD_GRADS": "on"}).offload_grads == "bf16"
    assert speedups({"DSTRAIN_OFFLOAD_GRADS": " FP32 "}).offload_grads == "fp32"
    assert speedups({"DSTRAIN_OFFLOAD_GRADS": "off"}).offload_grads == "off"
    assert speedups({"DSTRAIN_OFFLOAD_GRADS": "0"}).offload_grads == "off"
    assert speedups({}, "speedups.offload_grads=false").offload_grads == "off"  # YAML's `off` is false


def test_the_accumulation_switch_reads_auto_on_and_off():
    from dstrain.speedups.registry import BY_NAME

    assert speedups({}).offload_accumulate == "auto"
    assert speedups({"DSTRAIN_OFFLOAD_ACCUMULATE": " Auto "}).offload_accumulate == "auto"
    assert speedups({"DSTRAIN_OFFLOAD_ACCUMULATE": "on"}).offload_accumulate is True
    assert speedups({"DSTRAIN_OFFLOAD_ACCUMULATE": "0"}).offload_accumulate is False
    assert speedups({}, "speedups.offload_accumulate=off").offload_accumulate is False  # YAML's `off` is false
    entry = BY_NAME["offload_accumulate_zero3"]
    assert entry.switched_on(speedups({})) and entry.switched_on(speedups({"DSTRAIN_OFFLOAD_ACCUMULATE": "1"}))
    assert entry.off_reason(speedups({"DSTRAIN_OFFLOAD_ACCUMULATE": "off"})) == "speedups.offload_accumulate=false"


def test_every_speedup_key_has_its_variable_and_set_wins_over_it():
    resolved = resolve(None, None, ["speedups.zero3_hooks=true"], world_size=1, accelerator="cpu",
                       env={"DSTRAIN_ZERO3_STEP": "off", "DSTRAIN_ZERO3_HOOKS": "off", "DSTRAIN_CUDA_STREAM": "0"})
    assert resolved.config.speedups.zero3_step is False and resolved.config.speedups.cuda_stream is False
    assert resolved.config.speedups.zero3_hooks is True  # --set is the highest layer
    assert resolved.sources["speedups.zero3_step"] == "DSTRAIN_ZERO3_STEP=off"


def test_a_bad_switch_value_names_its_variable():
    with pytest.raises(UserError) as err:
        speedups({"DSTRAIN_ZERO3_STEP": "fast"})
    assert "DSTRAIN_ZERO3_STEP=fast" in str(err.value) and "speedups.zero3_step" in str(err.value)


def test_every_registered_change_has_its_switch_in_the_config_and_known_prerequisites():
    from dstrain.config.schema import SpeedupsConfig
    from dstrain.speedups import REGISTRY, VERIFIED

    names = [entry.name for entry in REGISTRY]
    assert len(names) == len(set(names))
    for entry in REGISTRY:
        assert entry.switch in SpeedupsConfig.model_fields, entry.name
        assert set(entry.requires) <= set(names) and entry.name not in entry.requires, entry.name
        assert entry.replaces and all(r.startswith("deepspeed.") for r in entry.replaces), entry.name
        assert entry.verified_on == VERIFIED, entry.name
    # every switch turns at least one change on or off
    switches = {entry.switch for entry in REGISTRY}
    assert switches | {"offload_chunk_elements", "offload_overlap_threads", "offload_gil_handoff"} == set(
        SpeedupsConfig.model_fields)
