"""dstrain/speedups/offload_syncs.py, offload_chunked_step.py and offload_accumulate_zero12.py: the ZeRO-1/2
CPU-offload optimizer without its per-parameter waits, with its step done in chunks, with bf16 gradients
sent to the host (bf16 weights), and with its accumulated gradients kept on the device, trains exactly as
DeepSpeed's own (real engines, DeepSpeedCPUAdam, one CPU rank, in a
subprocess so its process group stays out of the test process: tests/scripts/offload_syncs.py).
Integration lane: DeepSpeed start-up and the CPU Adam op."""

from __future__ import annotations

import pytest
import torch

from one_rank import run_script

pytestmark = pytest.mark.integration

ALL_CASES = ((2, "fp32", 1, 0.05, None), (1, "fp32", 2, 0.05, None), (2, "bf16", 1, 0.05, None),
             (2, "fp32", 1, 100.0, None), (2, "bf16", 1, 0.05, 1), (1, "bf16", 2, 0.05, None),
             (2, "bf16", 1, 100.0, None))
# ZeRO-2 at accumulation 2 and 3, fp32 and bf16, clipped and not; the last also past a skipped step and
# beside the other patches (composed). Only ZeRO-2 accumulates through the host.
ACCUMULATE_CASES = ((2, "fp32", 2, 100.0, None, False), (2, "fp32", 3, 0.05, None, False),
                    (2, "bf16", 2, 100.0, None, False), (2, "bf16", 3, 0.05, 1, True))
# why the accumulation on the device skips ALL_CASES (in their "dstrain" runs), by stage and accumulation
NOT_ACCUMULATED = {(1, 2): "ZeRO-1 (its gradients reach the host once a step already)",
                   (2, 1): "no gradient accumulation"}


@pytest.fixture(scope="module")
def all_runs():
    return run_script("offload_syncs", {"cases": ALL_CASES, "accumulate_cases": ACCUMULATE_CASES})


@pytest.fixture(scope="module")
def runs(all_runs):
    return {key: by_patch for key, by_patch in all_runs.items() if not key.startswith("accumulate-")}


@pytest.fixture(scope="module")
def accumulate_runs(all_runs):
    return {key: by_patch for key, by_patch in all_runs.items() if key.startswith("accumulate-")}


def _not_accumulated(key: str) -> str:
    stage, _, accum = key.split("-")[:3]
    return NOT_ACCUMULATED[int(stage), int(accum)]


def test_offload_optimizer_without_per_parameter_syncs_trains_as_deepspeeds_own(runs):
    for key, by_patch in runs.items():
        ours, theirs = by_patch["dstrain"], by_patch["deepspeed"]
        assert ours["applied"] == {"syncs": True, "chunks": True, "accumulate": _not_accumulated(key)}, key
        overflow_checked = key.endswith("overflow")
        assert ours["tracker_patched"] is not overflow_checked and not theirs["tracker_patched"], key
        assert len(ours["norms"]) == len(theirs["norms"]) >= 4, key
        finite = [n for n in theirs["norms"] if n != float("inf")]
        assert ours["norms"] == pytest.approx(theirs["norms"], rel=1e-6), key
        assert min(finite) > 0.05, key  # so a clip at 0.05 acts on every step, one at 100 on none
        assert ours["weights"] == pytest.approx(theirs["weights"], rel=1e-6, abs=1e-7), key
        assert ours["skipped"] == theirs["skipped"] == (1 if overflow_checked else 0), key


def test_offload_step_in_chunks_is_bit_identical_to_deepspeeds_step(runs):
    """Same gradient norm code on both sides: the chunked update must give exactly DeepSpeed's weights."""
    for key, by_patch in runs.items():
        assert by_patch["syncs"]["weights"] == by_patch["dstrain"]["weights"], key
        assert by_patch["syncs"]["norms"] == by_patch["dstrain"]["norms"], key


def test_bf16_gradients_on_the_host_give_deepspeeds_weights_bit_for_bit(runs):
    """bf16 weights: the gradients reach the host in bf16 and the Adam op widens them (times the clip
    factor, with and without clipping, with accumulation, past a skipped overflow step): exactly the
    weights of DeepSpeed's step on fp32 gradients. fp32 weights keep DeepSpeed's copies."""
    for key, by_patch in runs.items():
        ours = by_patch["bf16"]
        assert ours["applied"] == {"syncs": True, "chunks": True, "bf16": "-bf16-" in key}, key
        assert ours["weights"] == by_patch["syncs"]["weights"], key
        assert ours["norms"] == by_patch["syncs"]["norms"], key
        assert ours["skipped"] == by_patch["syncs"]["skipped"], key


def test_accumulated_gradients_on_the_device_give_deepspeeds_weights_bit_for_bit(accumulate_runs):
    """ZeRO-2 with speedups.offload_accumulate on: the sums stay on the device between micro steps, and
    the weights, fp32 masters, gradient norms and skipped steps are exactly those of DeepSpeed's host
    round trips (alone, and beside the other patches, past a skipped step)."""
    assert len(accumulate_runs) == len(ACCUMULATE_CASES)
    for key, by_patch in accumulate_runs.items():
        ours, theirs = by_patch["accumulate"], by_patch["deepspeed"]
        assert ours["applied"] == {"accumulate": True}, key
        assert len(ours["norms"]) == len(theirs["norms"]) >= 4, key
        for value in ("weights", "masters", "norms", "skipped"):
            assert ours[value] == theirs[value], (key, value)
        if "all" in by_patch:
            everything = {"syncs": True, "chunks": True, "bf16": True, "accumulate": True}
            assert by_patch["all"]["applied"] == everything, key
            assert by_patch["all"]["skipped"] == theirs["skipped"] == 1, key
            for value in ("weights", "masters", "norms"):
                assert by_patch["all"][value] == by_patch["bf16"][value], (key, value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the chunked step rounds to bf16 there")
def test_offload_step_on_a_gpu_is_bit_identical_to_deepspeeds_step():
    """On a GPU the chunked step sends fp32 chunks and rounds them to bf16 on the device (pinned weights)."""
    cases = ((2, "bf16", 1, 0.05, None), (1, "bf16", 2, 0.05, None), (2, "bf16", 1, 100.0, None))
    accumulate_cases = ((2, "bf16", 3, 0.05, None, True),)
    out = run_script("offload_syncs", {"cases": cases, "accumulate_cases": accumulate_cases}, accelerator="cuda")
    # and the sums kept on the GPU between micro steps, alone and beside the others
    for key in [key for key in out if key.startswith("accumulate-")]:
        by_patch = out.pop(key)
        assert by_patch["accumulate"]["applied"] == {"accumulate": True}, key
        assert by_patch["all"]["applied"] == {"syncs": True, "chunks": True, "bf16": True, "accumulate": True}, key
        for value in ("weights", "masters", "norms"):
            assert by_patch["accumulate"][value] == by_patch["deepspeed"][value], (key, value)
            assert by_patch["all"][value] == by_patch["bf16"][value], (key, value)
    for key, by_patch in out.items():
        assert by_patch["dstrain"]["applied"] == {"syncs": True, "chunks": True,
                                                  "accumulate": _not_accumulated(key)}, key
        assert by_patch["dstrain"]["pinned"], key  # so the fp32 chunks go to the GPU and are rounded there
        assert by_patch["syncs"]["weights"] == by_patch["dstrain"]["weights"], key
        # and with the gradients sent in bf16 into the pinned weight buffer, the rounding on the GPU
        assert by_patch["bf16"]["applied"] == {"syncs": True, "chunks": True, "bf16": True}, key
        assert by_patch["syncs"]["weights"] == by_patch["bf16"]["weights"], key
        assert by_patch["dstrain"]["weights"] == pytest.approx(by_patch["deepspeed"]["weights"], rel=1e-6, abs=1e-7), key
