"""dstrain/speedups/offload_chunked_step_zero3.py and offload_grads_zero3.py: ZeRO-3 CPU offload with the step done
in chunks and each gradient copied to the host once (in bf16 where the weights and the gradient
accumulation are bf16) trains bit for bit as DeepSpeed's own step and copies
(real engines, DeepSpeedCPUAdam, one rank in a subprocess so its process group stays out of the test
process). Integration lane: DeepSpeed start-up and the CPU Adam op."""

from __future__ import annotations

import pytest
import torch

from one_rank import TINY_MLP, run_one_rank

pytestmark = pytest.mark.integration

SCRIPT = TINY_MLP + """
    import time
    from dstrain.config.schema import SpeedupsConfig
    from dstrain.speedups import apply, state_of
    CHANGES = ("offload_chunks_zero3", "offload_grads_zero3", "offload_bf16_grads_zero3")

    device = "cuda" if os.environ["DS_ACCELERATOR"] == "cuda" else "cpu"

    class SlowAdam:
        # DeepSpeed's CPU Adam op, each call 3 ms late: the overlapped step is still running when the
        # next forward gathers its first parameters, so the test sees the waits do their work.
        def __init__(self, op):
            self.op = op

        def adam_update(self, *args):
            time.sleep(0.003)
            return self.op.adam_update(*args)

        def adam_update_tiles(self, *args):
            time.sleep(0.003)
            return self.op.adam_update_tiles(*args)

        def __getattr__(self, name):
            return getattr(self.op, name)

    def train(precision, accum, clip, offload_param, variant, overflow_at=None, accum_dtype=None):
        model = tiny_mlp()  # 6,337 parameters
        pin = device == "cuda"
        zero = {"stage": 3, "sub_group_size": 4000,  # two sub-groups: 4,224 and 2,113 elements
                # PERSIST 100: the biases and the last layer's weight stay gathered between steps
                "stage3_param_persistence_threshold": PERSIST,
                "offload_optimizer": {"device": "cpu", "pin_memory": pin}}
        if offload_param:
            zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
        config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": accum,
                  "gradient_clipping": clip, "zero_optimization": zero,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}}
        if precision == "bf16":
            config["bf16"] = {"enabled": True, "check_grad_overflow": overflow_at is not None}
        if accum_dtype:
            config["data_types"] = {"grad_accum_dtype": accum_dtype}
        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
        # chunks of 1,024: each sub-group in several, the last one short
        applied = None
        if variant != "deepspeed":  # gpu_rounding: the bf16 rounding off the Adam pass, on the GPU if any
            settings = SpeedupsConfig(offload_chunk_elements=1024, offload_host_rounding=variant != "gpu_rounding")
            done = apply(engine, settings, only=CHANGES + ("offload_host_rounding",)).applied
            applied = [name in done for name in CHANGES]
        if variant == "overlap":
            applied.append("offload_overlap" in apply(engine, settings, only=("offload_overlap",)).applied)
            state_of(engine).overlap.adam_op = SlowAdam(state_of(engine).overlap.adam_op)
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        norms = train_tiny_mlp(engine, 4 * accum, dtype, device, overflow_at)
        optimizer = engine.optimizer
        overlap = getattr(state_of(engine), "overlap", None)
        if overlap is not None:
            overlap.drain()  # the last step's update: read below
        masters = torch.cat([m.detach().flatten() for m in optimizer.fp32_partitioned_groups_flat]).tolist()
        bit16 = torch.cat([f.detach().float().flatten().cpu() for f in optimizer.fp16_partitioned_groups_flat]).tolist()
        return {"applied": applied, "norms": norms, "masters": masters, "bit16": bit16,
                "sub_groups": len(optimizer.fp16_groups), "skipped": engine.skipped_steps,
                # DeepSpeed's host copy of the gradient partitions: the direct copy leaves it unwritten
                "host_buffer_written": bool(optimizer.grad_partitions_flat_buffer.abs().sum() > 0),
                "pinned": all(m.is_pinned() for m in optimizer.fp32_partitioned_groups_flat),
                "rounded_by_adam": getattr(state_of(engine), "round_op", None) is not None,
                "persistent": len(optimizer.persistent_parameters),
                "overlapped_steps": overlap.steps if overlap else None, "waits": overlap.waits if overlap else None}

    out = {}
    for precision, accum, clip, offload_param, overflow_at, accum_dtype in CASES:
        key = f"{precision}-{accum}-clip{clip}" + ("-offload_param" if offload_param else "") + (
            "-overflow" if overflow_at is not None else "") + (f"-accum_{accum_dtype}" if accum_dtype else "")
        out[key] = {name: train(precision, accum, clip, offload_param, name, overflow_at, accum_dtype)
                    for name in ("deepspeed",) + VARIANTS}
    result(out)
"""

# A clip of 0.05 is below every norm here (each step clips); 100 is above them (factor 1: no multiply).
# Accumulation 2 takes DeepSpeed's gradient copies at each micro-step (the direct copy is for a step's only
# micro-step); grad_accum_dtype fp32 widens bf16 gradients in the host buffer that the direct copy skips.
CPU_CASES = (("bf16", 1, 0.05, True, None, None), ("fp32", 2, 0.05, True, None, None),
             ("bf16", 1, 100.0, False, None, None), ("bf16", 1, 0.05, True, 1, None),
             ("bf16", 1, 0.05, True, None, "fp32"))


def _script(cases, variants: tuple = ("dstrain",), persist: int = 0) -> str:
    return f"    CASES = {cases!r}\n    VARIANTS = {variants!r}\n    PERSIST = {persist!r}\n" + SCRIPT


def _assert_bit_identical(out: dict, on_gpu: bool, variant: str = "dstrain") -> None:
    for key, by_name in out.items():
        ours, theirs = by_name[variant], by_name["deepspeed"]
        in_bf16 = key.startswith("bf16") and not key.endswith("accum_fp32")  # bf16 weights and accumulation
        assert ours["applied"] == [True, True, in_bf16] + ([True] if variant == "overlap" else []), key
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
        # accumulating (DeepSpeed's copies), or the bf16 copy, which goes there
        assert ours["host_buffer_written"] is (key.startswith(("bf16-2", "fp32-2")) or in_bf16), key
        assert ours["masters"] != pytest.approx([0.0] * len(ours["masters"])), key


def test_zero3_offload_step_in_chunks_and_direct_grads_are_bit_identical_to_deepspeeds():
    """The new weights rounded to bf16 by dstrain's Adam op in its pass, from bf16 gradients and (fp32
    accumulation) fp32 ones, with and without clipping; and, switched off, in a pass of their own."""
    out = run_one_rank(_script(CPU_CASES, ("dstrain", "gpu_rounding")))
    _assert_bit_identical(out, on_gpu=False)
    _assert_bit_identical(out, on_gpu=False, variant="gpu_rounding")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the chunked step rounds to bf16 there")
def test_zero3_offload_step_on_a_gpu_is_bit_identical_to_deepspeeds_step():
    """On a GPU the fp32 chunks go to the device, are rounded there, and come back to the host partition
    (parameter offload) or stay in the GPU partition (optimizer offload alone)."""
    cases = (("bf16", 1, 0.05, True, None, None), ("bf16", 2, 0.05, True, None, None),
             ("bf16", 1, 100.0, False, None, None), ("bf16", 1, 0.05, True, None, "fp32"))
    out = run_one_rank(_script(cases, ("dstrain", "gpu_rounding")), accelerator="cuda")
    _assert_bit_identical(out, on_gpu=True)
    _assert_bit_identical(out, on_gpu=True, variant="gpu_rounding")


# Parameter offload or not, accumulation, an overflow step; persistent parameters in every case.
OVERLAP_CASES = (("bf16", 1, 0.05, True, None, None), ("fp32", 2, 0.05, True, None, None),
                 ("bf16", 1, 100.0, False, None, None), ("bf16", 1, 0.05, True, 1, None))


def _assert_overlapped(out: dict, on_gpu: bool) -> None:
    _assert_bit_identical(out, on_gpu, variant="overlap")
    for key, by_name in out.items():
        ours = by_name["overlap"]
        assert ours["persistent"] == 4, key  # three biases and the last weight: gathered by the next forward
        assert ours["overlapped_steps"] == 4 - ours["skipped"], key  # every update ran on the worker
        assert ours["waits"] >= ours["overlapped_steps"] - 1, key  # each next forward met a step in progress


def test_zero3_offload_step_beside_the_next_forward_is_bit_identical_to_deepspeeds():
    """offload_overlap_zero3.py: the step's chunks on a worker thread, slowed down, while the next forward
    gathers each parameter only once its chunks have landed: the same weights and norms as DeepSpeed's."""
    _assert_overlapped(run_one_rank(_script(OVERLAP_CASES, ("overlap",), persist=100)), on_gpu=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the worker queues its copies on a CUDA stream")
def test_zero3_offload_step_beside_the_next_forward_on_a_gpu_is_bit_identical_to_deepspeeds():
    _assert_overlapped(run_one_rank(_script(OVERLAP_CASES, ("overlap",), persist=100), accelerator="cuda"), on_gpu=True)


GIL_SCRIPT = """
    import sys, threading, time
    from deepspeed.ops.op_builder import CPUAdamBuilder
    from dstrain.speedups.cpu_adam_nogil import load_adam_without_gil

    sys.setswitchinterval(0.001)  # a thread that waits for the GIL gets it back within about 1 ms
    n = 1 << 25
    tensors = [torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)]

    def longest_pause(op, opt_id):
        # The training thread's longest pause, in seconds, while another thread runs three updates, and
        # how long one update takes on this thread (the pause a held GIL causes; it depends on the host).
        op.create_adam(opt_id, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, False)
        op.adam_update(opt_id, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, *tensors)  # warm: threads, caches
        started = time.perf_counter()
        op.adam_update(opt_id, 2, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, *tensors)
        one_update = time.perf_counter() - started
        worker = threading.Thread(target=lambda: [op.adam_update(opt_id, s, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, *tensors)
                                                  for s in (3, 4, 5)])
        last, longest = time.perf_counter(), 0.0
        worker.start()
        while worker.is_alive():
            now = time.perf_counter()
            longest, last = max(longest, now - last), now
        return longest, one_update

    result({"deepspeed": longest_pause(CPUAdamBuilder().load(), 90), "dstrain": longest_pause(load_adam_without_gil(), 91)})
"""


def test_the_worker_threads_adam_kernel_leaves_the_gil_to_the_training_thread():
    """cpu_adam_nogil.py: DeepSpeed's cpu_adam binding holds the GIL through an update, so Python on another
    thread stops for all of it; dstrain's build of the same kernel lets it run."""
    # The kernel on one OpenMP thread, so that a core is left for the training thread: on two cores an
    # update on both starves it whether or not the GIL is held (9 ms pauses in one CI run), and this
    # test is about the GIL.
    pauses = run_one_rank(GIL_SCRIPT, env={"OMP_NUM_THREADS": "1"})
    (deepspeed_pause, deepspeed_update), (dstrain_pause, dstrain_update) = pauses["deepspeed"], pauses["dstrain"]
    # a 32M-element update on one thread takes tens of ms; with the GIL held the training thread stops
    # for most of one, with it released only for about the switch interval
    assert deepspeed_update > 0.005 and dstrain_update > 0.005, (deepspeed_update, dstrain_update)
    assert deepspeed_pause > 0.6 * deepspeed_update, (deepspeed_pause, deepspeed_update)
    assert dstrain_pause < deepspeed_pause / 2, (dstrain_pause, deepspeed_pause)
