"""dstrain/rank/offload.py's environment switches: off, on, or a number for tuning (fast lane)."""

from __future__ import annotations

from dstrain.switches import number_or_switch


def test_an_offload_switch_reads_off_on_and_a_number():
    name = "DSTRAIN_OFFLOAD_OVERLAP"
    assert number_or_switch({}, name, -1) == -1  # unset: the default
    assert [number_or_switch({name: v}, name, -1) for v in ("0", "off", " No ", "false")] == [0] * 4
    assert [number_or_switch({name: v}, name, -1) for v in ("1", "on", "yes", "fast")] == [-1] * 4  # "1" is on
    assert number_or_switch({name: "8"}, name, -1) == 8
    assert number_or_switch({"DSTRAIN_OFFLOAD_CHUNKS": "4096"}, "DSTRAIN_OFFLOAD_CHUNKS", 1 << 23) == 4096


def test_the_gradient_copy_switch_reads_bf16_fp32_and_off():
    from dstrain.rank.offload import gradient_copies

    assert gradient_copies({}) == gradient_copies({"DSTRAIN_OFFLOAD_GRADS": "on"}) == "bf16"
    assert gradient_copies({"DSTRAIN_OFFLOAD_GRADS": " FP32 "}) == "fp32"
    assert gradient_copies({"DSTRAIN_OFFLOAD_GRADS": "off"}) == gradient_copies({"DSTRAIN_OFFLOAD_GRADS": "0"}) == "deepspeed"
