"""Builds the DeepSpeed JIT ops that CPU ranks load, into the op cache those ranks use (dstrain/op_cache.py),
then exits. tests/conftest.py starts it in the background when a session holds launcher tests: on a 2-core
machine the fast lane keeps one core busy, so the builds (about 100 s each, async_io over 3 minutes) run on
the other instead of inside the first launcher tests. A rank that needs an op still being built waits on
torch's build lock, then loads it; nothing is built twice.

Usage: python -m scripts.build_ops [--nvme]   (from tests/, as conftest runs it)"""

from __future__ import annotations

import os
import sys
import time

# What CPU ranks build: the comm op at init_distributed, DeepSpeed's Adam for the optimizer (fused on the
# device, CPU Adam with offload), async_io for NVMe offload (needs libaio).
BUILDERS = ("ShareMemCommBuilder", "CPUAdamBuilder", "FusedAdamBuilder")


def main() -> None:
    from dstrain.op_cache import use_private_op_cache
    os.environ["DS_ACCELERATOR"] = "cpu"
    use_private_op_cache(os.environ, "cpu")
    from deepspeed.accelerator import get_accelerator

    names = [*BUILDERS, *(("AsyncIOBuilder",) if "--nvme" in sys.argv else ())]
    for name in names:
        builder = get_accelerator().create_op_builder(name)
        started = time.monotonic()
        if builder is None or not builder.is_compatible(verbose=False):
            print(f"{name}: not buildable here", flush=True)
            continue
        builder.load(verbose=False)
        print(f"{name}: ready in {time.monotonic() - started:.0f} s", flush=True)
    # dstrain's GIL-free Adam, where the speed layer applies (a verified DeepSpeed)
    from dstrain.speedups.cpu_adam_nogil import load_adam_without_gil
    from dstrain.speedups.registry import unverified
    if unverified() is None:
        started = time.monotonic()
        load_adam_without_gil()
        print(f"dstrain_cpu_adam_nogil: ready in {time.monotonic() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
