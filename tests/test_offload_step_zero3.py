"""dstrain/speedups/offload_chunked_step_zero3.py, offload_grads_zero3.py and offload_accumulate_zero3.py: ZeRO-3
CPU offload with the step done in chunks and each gradient copied to the host once (in bf16 where the
weights and the gradient accumulation are bf16; summed on the device until then where it accumulates)
trains bit for bit as DeepSpeed's own step and copies
(real engines, DeepSpeedCPUAdam, one rank in a subprocess so its process group stays out of the test
process: tests/scripts/offload_step_zero3.py; the CPU cases of three tests in one such process). Integration
lane: DeepSpeed start-up and the CPU Adam op."""

from __future__ import annotations

import pytest
import torch

from one_rank import run_script

pytestmark = pytest.mark.integration

# A clip of 0.05 is below every norm here (each step clips); 100 is above them (factor 1: no multiply).
# Accumulation 2 takes DeepSpeed's gradient copies at each micro-step (without offload_accumulate the direct
# copy is for a step's only micro-step); grad_accum_dtype fp32 widens bf16 gradients in the host buffer that
# the direct copy skips.
CPU_CASES = (("bf16", 1, 0.05, True, None, None), ("fp32", 2, 0.05, True, None, None),
             ("bf16", 1, 100.0, False, None, None), ("bf16", 1, 0.05, True, 1, None),
             ("bf16", 1, 0.05, True, None, "fp32"))


def _params(cases, variants: tuple = ("dstrain",), persist: int = 0) -> dict:
    return {"cases": cases, "variants": variants, "persist": persist}


def _assert_bit_identical(out: dict, on_gpu: bool, variant: str = "dstrain") -> None:
    out = {key: by_name for key, by_name in out.items() if variant in by_name}  # the cases run with `variant`
    assert out, variant
    for key, by_name in out.items():
        ours, theirs = by_name[variant], by_name["deepspeed"]
        in_bf16 = key.startswith("bf16") and not key.endswith("accum_fp32")  # bf16 weights and accumulation
        accumulating, summed_on_device = int(key.split("-")[1]) > 1, variant.endswith("accumulate")
        assert ours["applied"] == [True, True, in_bf16] + ([True] if variant.startswith("overlap") else []), key
        assert ours["accumulated"] is (True if summed_on_device else None), key
        assert theirs["applied"] is None, key
        assert ours["sub_groups"] == 2, key
        # The Adam pass rounds the weights where every bf16 partition is in host memory: on a CPU rank,
        # and with parameter offload on a GPU; elsewhere pinned masters go to the GPU to be rounded there.
        on_host = key.startswith("bf16") and (not on_gpu or key.find("offload_param") > 0)
        assert ours["rounded_by_adam"] is (on_host and variant != "gpu_rounding"), key
        assert ours["pinned"] is (on_gpu and not ours["rounded_by_adam"]), key
        assert len(ours["norms"]) >= 4 and ours["norms"] == theirs["norms"], key
        assert min(n for n in theirs["norms"] if n != float("inf")) > 0.05, key
        assert ours["masters"] == theirs["masters"], key
        assert ours["bit16"] == theirs["bit16"], key
        assert ours["skipped"] == theirs["skipped"] == (1 if key.endswith("overflow") else 0), key
        assert theirs["host_buffer_written"] is True, key
        # accumulating through DeepSpeed's copies, or the bf16 copy, which goes there
        assert ours["host_buffer_written"] is ((accumulating and not summed_on_device) or in_bf16), key
        assert ours["masters"] != pytest.approx([0.0] * len(ours["masters"])), key


# offload_accumulate_zero3.py, forced on (auto keeps it to CUDA): accumulation 2 and 3, bf16 and fp32
# accumulation dtype, clipping or not, parameter offload or not, non-finite gradients at a micro step
# after the first (the sum carries them to the boundary's norm: a skipped step).
ACCUMULATE_CASES = (("bf16", 2, 0.05, True, 1, None), ("bf16", 3, 100.0, False, None, "fp32"),
                    ("fp32", 3, 0.05, False, None, None))


# Parameter offload or not, accumulation, an overflow step; persistent parameters in every case.
OVERLAP_CASES = (("bf16", 1, 0.05, True, None, None), ("fp32", 2, 0.05, True, None, None),
                 ("bf16", 1, 100.0, False, None, None), ("bf16", 1, 0.05, True, 1, None))


@pytest.fixture(scope="module")
def on_cpu() -> dict:
    """The CPU cases of the three CPU tests below, trained by one rank (one start-up), by group: "step"
    (the chunked step, and with its bf16 rounding in a pass of its own), "accumulate" (the sums on the device) and
    "overlap" (the step beside the next forward, persistent parameters: threshold 100), in that order."""
    return run_script("offload_step_zero3", {"groups": {
        "step": (CPU_CASES, ("dstrain", "gpu_rounding"), 0), "accumulate": (ACCUMULATE_CASES, ("accumulate",), 0),
        "overlap": (OVERLAP_CASES, ("overlap",), 100)}})


def test_zero3_offload_step_in_chunks_and_direct_grads_are_bit_identical_to_deepspeeds(on_cpu):
    """The new weights rounded to bf16 by dstrain's Adam op in its pass, from bf16 gradients and (fp32
    accumulation) fp32 ones, with and without clipping; and, switched off, in a pass of their own.
    Reads `on_cpu`'s "step" group."""
    _assert_bit_identical(on_cpu["step"], on_gpu=False)
    _assert_bit_identical(on_cpu["step"], on_gpu=False, variant="gpu_rounding")


def test_zero3_offload_gradients_summed_on_the_device_are_bit_identical_to_deepspeeds(on_cpu):
    """The micro steps' gradient partitions summed in device buffers, sent to the host once at the
    boundary: the same norms, masters and bf16 weights as DeepSpeed's host-buffer sums. (Beside the
    overlapped step: test_run.py's two-rank stage3_offload test, and the GPU test below.) Reads `on_cpu`'s
    "accumulate" group."""
    _assert_bit_identical(on_cpu["accumulate"], on_gpu=False, variant="accumulate")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the chunked step rounds to bf16 there")
def test_zero3_offload_step_on_a_gpu_is_bit_identical_to_deepspeeds_step():
    """On a GPU the fp32 chunks go to the device, are rounded there, and come back to the host partition
    (parameter offload) or stay in the GPU partition (optimizer offload alone)."""
    cases = (("bf16", 1, 0.05, True, None, None), ("bf16", 2, 0.05, True, None, None),
             ("bf16", 1, 100.0, False, None, None), ("bf16", 1, 0.05, True, None, "fp32"))
    out = run_script("offload_step_zero3", _params(cases, ("dstrain", "gpu_rounding")), accelerator="cuda")
    _assert_bit_identical(out, on_gpu=True)
    _assert_bit_identical(out, on_gpu=True, variant="gpu_rounding")


def _assert_overlapped(out: dict, on_gpu: bool, variant: str = "overlap") -> None:
    _assert_bit_identical(out, on_gpu, variant=variant)
    for key, by_name in out.items():
        ours = by_name[variant]
        assert ours["persistent"] == 4, key  # three biases and the last weight: gathered by the next forward
        assert ours["overlapped_steps"] == 4 - ours["skipped"], key  # every update ran on the worker
        assert ours["waits"] >= ours["overlapped_steps"] - 1, key  # each next forward met a step in progress


def test_zero3_offload_step_beside_the_next_forward_is_bit_identical_to_deepspeeds(on_cpu):
    """offload_overlap_zero3.py: the step's chunks on a worker thread, slowed down, while the next forward
    gathers each parameter only once its chunks have landed: the same weights and norms as DeepSpeed's.
    Reads `on_cpu`'s "overlap" group (formerly a one-rank process of its own)."""
    _assert_overlapped(on_cpu["overlap"], on_gpu=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the worker queues its copies on a CUDA stream")
def test_zero3_offload_step_beside_the_next_forward_on_a_gpu_is_bit_identical_to_deepspeeds():
    _assert_overlapped(run_script("offload_step_zero3", _params(OVERLAP_CASES, ("overlap",), persist=100), accelerator="cuda"), on_gpu=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the sums live on its reduce stream")
def test_zero3_offload_gradients_summed_on_a_gpu_are_bit_identical_to_deepspeeds():
    """On the GPU the sums are made on DeepSpeed's reduce stream and copied to the host from there; the
    overlapped step's worker reads the host buffers while the next forward runs."""
    out = run_script("offload_step_zero3", _params(ACCUMULATE_CASES, ("accumulate", "overlap_accumulate"), persist=100),
                     accelerator="cuda")
    _assert_bit_identical(out, on_gpu=True, variant="accumulate")
    _assert_overlapped(out, on_gpu=True, variant="overlap_accumulate")


def test_the_worker_threads_adam_kernel_leaves_the_gil_to_the_training_thread():
    """cpu_adam_nogil.py: DeepSpeed's cpu_adam binding holds the GIL through an update, so Python on another
    thread stops for all of it; dstrain's build of the same kernel lets it run."""
    # The kernel on one OpenMP thread, so that a core is left for the training thread: on two cores an
    # update on both starves it whether or not the GIL is held (9 ms pauses in one CI run), and this
    # test is about the GIL.
    pauses = run_script("adam_gil", {}, env={"OMP_NUM_THREADS": "1"})
    (deepspeed_pause, deepspeed_update), (dstrain_pause, dstrain_update) = pauses["deepspeed"], pauses["dstrain"]
    # a 32M-element update on one thread takes tens of ms; with the GIL held the training thread stops
    # for most of one, with it released only for about the switch interval (the calmest of three tries each,
    # the update timed in the same window: a loaded machine's stalls are not the GIL's)
    assert deepspeed_update > 0.005 and dstrain_update > 0.005, (deepspeed_update, dstrain_update)
    assert deepspeed_pause > 0.6 * deepspeed_update, (deepspeed_pause, deepspeed_update)
    assert dstrain_pause < deepspeed_pause / 2, (dstrain_pause, deepspeed_pause)
