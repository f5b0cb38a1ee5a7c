"""dstrain/speedups/zero3_step.py: ZeRO-3's step with the release, the norm and the persistent parameters'
gather batched, and each update reading the gradient buffer instead of a flattened copy, trains as
DeepSpeed's own step does: the same weights to the bit without clipping, the
same norms to rounding, the same skipped steps; and the gather after the step is one collective instead
of one a parameter (real engines, one rank and two CPU ranks in subprocesses so their process groups
stay out of the test process: tests/scripts/zero3_step.py). Integration lane: DeepSpeed start-up."""

from __future__ import annotations

import pytest
import torch

from one_rank import run_one_rank, run_script

pytestmark = pytest.mark.integration

# A clip of 0.05 is below every norm here (each step clips); 0 turns clipping off. Accumulation 2 (the
# gradients added to their slots), with a reduce bucket of 3,000 elements (reduced twice in a backward; the
# 4,096-element weight reduced outside it); an overflow at the first micro-step (DeepSpeed skips that update).
CASES = (("bf16", 1, 0.0, None, None), ("bf16", 1, 0.05, None, None), ("fp32", 2, 0.0, None, 3000),
         ("bf16", 1, 0.0, 1, None))


def _assert_trains_as_deepspeed(out: dict, ranks: int) -> None:
    # CPU offload keeps its own step (offload_chunked_step_zero3.py) and its hooks
    assert out.pop("offload") == {"applied": False, "unhooked": 0}
    for key, by_name in out.items():
        # without the module hooks on the last layer (its weight and bias persistent), the same training
        unhooked = by_name.pop("unhooked")
        assert unhooked["unhooked"] == 1 and by_name["lean"]["unhooked"] == 0, key
        for name in ("norms", "masters", "bit16", "skipped", "gathers", "statuses_right", "persistent_current"):
            assert unhooked[name] == by_name["lean"][name], (key, name)
        if ranks == 1:  # a forward after a checkpoint load
            assert unhooked["reloaded_loss"][0] == unhooked["reloaded_loss"][1], key
    for key, by_name in out.items():
        ours, theirs = by_name["lean"], by_name["deepspeed"]
        assert ours["applied"] is True and ours["lean"] is True and theirs["lean"] is False, key
        assert len(ours["norms"]) >= 4, key
        assert ours["norms"] == pytest.approx(theirs["norms"], rel=1e-12), key  # both in fp64
        assert ours["skipped"] == theirs["skipped"] == (1 if key.endswith("overflow") else 0), key
        if key.split("-")[2] == "clip0.0":  # no clip factor made from the norm: the weights to the bit
            assert ours["masters"] == theirs["masters"], key
            assert ours["bit16"] == theirs["bit16"], key
        else:
            assert ours["masters"] == pytest.approx(theirs["masters"], rel=1e-5, abs=1e-7), key
        assert ours["statuses_right"] and theirs["statuses_right"], key
        assert ours["persistent"] == theirs["persistent"] == 4, key  # three biases and the last weight
        updates = 4 - ours["skipped"]
        # each sub-group's update read the gradient buffer's span, not a flattened copy (two sub-groups on
        # one rank; one on two, each rank's partitions being half as large)
        assert ours["sub_groups"] == theirs["sub_groups"] == (2 if ranks == 1 else 1), key
        assert ours["grad_views"] == ours["sub_groups"] * updates and theirs["grad_views"] == 0, key
        # after the last step the persistent parameters hold what their partitions make
        assert ours["persistent_current"] is True and theirs["persistent_current"] is True, key
        if ranks == 1:  # nothing to gather on one rank: each parameter's data is its partition
            assert ours["gathers"] == theirs["gathers"] == 0, key
        else:  # one collective a persistent parameter for DeepSpeed, one for all of them here
            assert theirs["gathers"] == 4 * updates, key
            assert ours["gathers"] == updates, key


def test_lean_zero3_step_trains_as_deepspeeds_step_on_one_rank():
    _assert_trains_as_deepspeed(run_script("zero3_step", {"cases": CASES}), ranks=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_lean_zero3_step_trains_as_deepspeeds_step_on_a_gpu():
    _assert_trains_as_deepspeed(run_script("zero3_step", {"cases": CASES}, accelerator="cuda"), ranks=1)


@pytest.mark.parametrize("accelerator", [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")),
])
def test_lean_zero3_step_trains_as_deepspeeds_step_on_two_ranks(accelerator):
    """Two ranks (gloo on CPU, NCCL on two GPUs), each holding half of every partition: the persistent
    parameters are gathered after each update, in one all-gather, whole and current."""
    results = run_script("zero3_step", {"cases": CASES[:1] + CASES[2:3]}, accelerator=accelerator, ranks=2)
    for out in results:
        _assert_trains_as_deepspeed(out, ranks=2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_fast_current_stream_is_torchs_current_stream():
    """speedups/cuda_stream.py: DeepSpeed's accelerator gives the stream torch would, outside a
    stream context and inside one."""
    out = run_one_rank("""
        from deepspeed.accelerator import get_accelerator
        from dstrain.speedups import cuda_stream
        accelerator = get_accelerator()
        applied = cuda_stream.applies() is None
        cuda_stream.install()
        side = torch.cuda.Stream()
        outside = accelerator.current_stream() == torch.cuda.current_stream()
        with torch.cuda.stream(side):
            inside = accelerator.current_stream() == side and accelerator.current_stream(0) == side
        result({"applied": applied, "outside": outside, "inside": inside})
    """, accelerator="cuda")
    assert out == {"applied": True, "outside": True, "inside": True}
