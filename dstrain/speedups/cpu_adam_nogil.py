"""DeepSpeed's CPU Adam kernel with the GIL released during each update (registry: cpu_adam_nogil).

DeepSpeed's cpu_adam binding holds the GIL for a whole update, which stops the training thread while
offload_overlap_zero3.py's worker updates. This op compiles DeepSpeed's own kernel source (included,
unchanged, by cpu_adam_nogil.cpp beside this file) with a binding that releases the GIL: the same
arithmetic, bit for bit. It adds adam_update_tiles, which runs the kernel tile by tile on gradients in
bf16 (widened in cache) or fp32, and can round the new weights to bf16 in the same pass. JIT-built like
DeepSpeed's ops, once per machine, into the same cache.
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


def applies(engine) -> str | None:
    """Why there is no DeepSpeedCPUAdam on `engine` to build the op for (None: there is)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    adam = getattr(getattr(engine, "optimizer", None), "optimizer", None)
    return None if isinstance(adam, DeepSpeedCPUAdam) else "no DeepSpeedCPUAdam (no CPU offload)"


def install(engine, state) -> str | None:
    """Build the op for `engine`'s DeepSpeedCPUAdam into state.adam_op; why not where it cannot be built."""
    state.adam_op = adam_without_gil(engine.optimizer.optimizer)
    return None if state.adam_op is not None else "the op could not be built here (no compiler or ninja?)"
