"""DeepSpeed's CPU Adam kernel with the GIL released during each update, for the offload worker thread
(offload_overlap_zero3.py).

DeepSpeed 0.19's cpu_adam binding holds the GIL for the whole update (a few ms per 8M-element chunk),
so a step on a worker thread stopped the training thread's Python for as long: measured on one H100,
the overlapped 1.3B step ran about 100 ms slower than on the main thread and the run lost 5-20%.
This op compiles DeepSpeed's own kernel source (csrc/adam/cpu_adam_impl.cpp, unchanged, included by
cpu_adam_nogil.cpp beside this file) with a binding of ours that releases the GIL: the same arithmetic,
bit for bit. The binding adds one update, adam_update_tiles, which runs DeepSpeed's Step_8 tile by tile
on gradients held in bf16 (offload_step.py's bf16_offload_grads: widened in cache) or fp32, and can round
the new weights to bf16 in the same pass (offload_step_zero3.py, parameters offloaded to the host). It is
JIT-built like DeepSpeed's ops, once per machine (about a minute), into the same cache.
"""

from __future__ import annotations

from pathlib import Path

BINDING = Path(__file__).resolve().parent / "cpu_adam_nogil.cpp"


def load_adam_without_gil():
    """The built op module (create_adam, destroy_adam, adam_update, adam_update_tiles), JIT-built on first use."""
    from deepspeed.ops.op_builder import CPUAdamBuilder

    class AdamWithoutGilBuilder(CPUAdamBuilder):
        NAME = "dstrain_cpu_adam_nogil"

        def absolute_name(self):
            return f"dstrain.ops.{self.NAME}_op"

        def sources(self):  # DeepSpeed's kernel file is included by the binding, not compiled beside it
            kernels = [path for path in super().sources()
                       if not path.endswith(("/cpu_adam.cpp", "/cpu_adam_impl.cpp"))]
            return [str(BINDING)] + kernels

        def include_paths(self):
            return list(super().include_paths()) + ["csrc/adam"]

    return AdamWithoutGilBuilder().load(verbose=False)


def adam_without_gil(adam):
    """An op that updates as `adam` (a DeepSpeedCPUAdam) does, with its optimizer registered under the
    same id in the op's own table; None if the op cannot be built here (the caller keeps DeepSpeed's)."""
    try:
        op = load_adam_without_gil()
    except Exception:  # no compiler, no ninja: the overlap is not worth having without it
        return None
    defaults = adam.defaults
    beta1, beta2 = defaults["betas"]
    # lr, betas, eps and weight decay are passed again with every update; AdamW mode is fixed here
    op.create_adam(adam.opt_id, defaults["lr"], beta1, beta2, defaults["eps"], defaults["weight_decay"],
                   adam.adam_w_mode, False)
    return op
