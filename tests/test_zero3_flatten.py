"""dstrain/speedups/zero3_flatten.py: ZeRO-3's parameter partitions flattened where they are, not through host
memory, give the engine the same flat buffer, the same views into it, and the same training (real
engines, one rank in a subprocess running tests/scripts/zero3_flatten.py, the CPU accelerator; on a GPU
the same code runs on the device)."""

from __future__ import annotations

import importlib

import pytest
import torch

from one_rank import run_script

# What this change replaces exists from DeepSpeed 0.19 on; on 0.18 stock DeepSpeed flattens (zero3_flatten.applies).
pytestmark = pytest.mark.skipif(not hasattr(importlib.import_module("deepspeed.runtime.zero.stage3"), "defragment"),
                                reason="this DeepSpeed has no stage3.defragment to replace")


def _assert_same(out: dict, device: str) -> None:
    ours, theirs = out["ours"], out["theirs"]
    assert out["calls"] == [6], out["calls"]  # one flatten of the MLP's six partitions, ours
    assert out["restored"] is True  # DeepSpeed's own function is back after the engine is built
    assert ours["dtype"] == theirs["dtype"] == "torch.bfloat16"
    assert ours["device"] == theirs["device"] == device
    assert len(ours["flat"]) == 6_337 and ours["flat"] == theirs["flat"]
    assert ours["views"] is True and theirs["views"] is True  # every partition lives in the buffer
    assert len(ours["norms"]) == 4 and ours["norms"] == theirs["norms"]
    assert ours["masters"] == theirs["masters"] and any(m != 0.0 for m in ours["masters"])


@pytest.mark.slow
@pytest.mark.oldest_deepspeed  # a real ZeRO-3 engine: the speed-up reads DeepSpeed's own buffers
def test_partitions_flattened_in_place_give_the_same_buffer_views_and_training():
    _assert_same(run_script("zero3_flatten", {}), "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: there the flatten stays on the device")
def test_partitions_flattened_on_a_gpu_give_the_same_buffer_views_and_training():
    _assert_same(run_script("zero3_flatten", {}, accelerator="cuda"), "cuda")
