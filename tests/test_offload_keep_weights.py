"""dstrain/speedups/offload_keep_weights.py: ZeRO-3 with the parameters offloaded and gradient accumulation,
the weights kept gathered between an accumulation window's micro steps, trains to the same bits as
DeepSpeed's releases, alone and beside every other default change (tests/scripts/offload_keep_weights.py,
real engines in subprocesses: one CPU rank, two CPU ranks whose weights are gathered from both, one GPU)."""

from __future__ import annotations

import pytest
import torch

from one_rank import run_script

pytestmark = pytest.mark.integration

ACCUM = 3


def _assert_kept_and_bit_identical(out: dict, width: int) -> None:
    theirs = out["deepspeed"]
    count = theirs["count"]  # 4 layers x (2 weights + 2 biases), none persistent
    assert theirs["applied"] is None
    # DeepSpeed releases every weight in the backward: nothing stays gathered between micro steps
    assert theirs["held"] == [0] * len(theirs["held"])
    for name in ("keep", "all"):
        ours = out[name]
        assert "offload_keep_weights" in ours["applied"], (name, ours["applied"])
        # the prefetcher's count of gathered weights is the one DeepSpeed's releases leave
        assert ours["counted"] == theirs["counted"], name
        assert ours["kept_bytes"] == 2 * 4 * (8 * width * width + 5 * width), name  # bf16, gathered whole
        # kept through the window, released at its last micro step (before the step moves the weights)
        assert ours["held"] == ([count] * (ACCUM - 1) + [0]) * (len(ours["held"]) // ACCUM), name
        assert ours["losses"] == theirs["losses"], name
        assert ours["losses"][-1] != ours["losses"][0], name  # it trained
        assert ours["weights"] == theirs["weights"] and ours["weights_sum"] == theirs["weights_sum"], name
        assert ours["masters"] == theirs["masters"] and ours["masters_sum"] == theirs["masters_sum"], name


def test_weights_kept_between_micro_steps_train_as_deepspeeds_releases_on_one_rank():
    _assert_kept_and_bit_identical(run_script("offload_keep_weights", {"windows": 2, "accum": ACCUM, "width": 64}), 64)


def test_weights_gathered_from_two_ranks_and_kept_train_as_deepspeeds_releases():
    one, two = run_script("offload_keep_weights", {"windows": 2, "accum": ACCUM, "width": 64}, ranks=2)
    _assert_kept_and_bit_identical(one, 64)
    _assert_kept_and_bit_identical(two, 64)
    assert one["deepspeed"]["losses"] != two["deepspeed"]["losses"]  # each rank trained on its own batches
    assert one["deepspeed"]["weights"] != two["deepspeed"]["weights"]  # each holds its own partition


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the fetches are host-to-GPU copies there")
def test_weights_kept_on_a_gpu_train_as_deepspeeds_releases():
    _assert_kept_and_bit_identical(run_script("offload_keep_weights", {"windows": 2, "accum": ACCUM, "width": 256},
                                              accelerator="cuda"), 256)
