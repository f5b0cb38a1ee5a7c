"""Builds the DeepSpeed JIT ops that CPU ranks load, into the op cache those ranks use (dstrain/op_cache.py),
then exits. tests/conftest.py starts it in the background when a session holds launcher tests: on a 2-core
machine the fast lane keeps one core busy, so the builds (about 100 s each, async_io over 3 minutes) run on
the other instead of inside the first launcher tests. The tests that start ranks wait for it at the gate
(tests/op_gate.py): the base ops first, async_io last, each part's gate file written when that part is
done, built or not. Nothing is built twice, and no test's timeout kills a build halfway.

Usage: python -m scripts.build_ops GATE_PREFIX [--nvme]   (from tests/, as conftest runs it)"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import time
from pathlib import Path

from op_gate import BASE, NVME, open_gate

# What CPU ranks build: DeepSpeed's Adam for the optimizer (fused on the device, the common case; CPU Adam
# with offload), async_io for NVMe offload (needs libaio). Not the shared-memory comm op: dstrain's ranks
# and the tests' scripts skip it (dstrain/rank/runtime.py skip_shared_memory_all_reduce_op).
BUILDERS = ("FusedAdamBuilder", "CPUAdamBuilder")


def main() -> None:
    gate = sys.argv[1]
    said: list[str] = []
    try:
        _build_base(said)
    finally:
        open_gate(gate, BASE, "\n".join(said))
    try:
        if "--nvme" in sys.argv:
            _build(["AsyncIOBuilder"], said)
    finally:
        open_gate(gate, NVME, "\n".join(said))


def _build_base(said: list[str]) -> None:
    from dstrain.op_cache import remember_cpu_info, use_private_op_cache
    os.environ["DS_ACCELERATOR"] = "cpu"
    remember_cpu_info(use_private_op_cache(os.environ, "cpu"))  # DeepSpeed asks twice per op, 1 s of CPU each
    _compile_with_precompiled_headers()
    _build(BUILDERS, said)
    # dstrain's GIL-free Adam, where the speed layer applies (a verified DeepSpeed)
    from dstrain.speedups.cpu_adam_nogil import load_adam_without_gil
    from dstrain.speedups.registry import unverified
    if unverified() is None:
        started = time.monotonic()
        load_adam_without_gil()
        _say(said, f"dstrain_cpu_adam_nogil: ready in {time.monotonic() - started:.0f} s")


def _build(names, said: list[str]) -> None:
    from deepspeed.accelerator import get_accelerator
    for name in names:
        builder = get_accelerator().create_op_builder(name)
        started = time.monotonic()
        if builder is None or not builder.is_compatible(verbose=False):
            _say(said, f"{name}: not buildable here")
            continue
        builder.load(verbose=False)
        _say(said, f"{name}: ready in {time.monotonic() - started:.0f} s")


def _compile_with_precompiled_headers() -> None:
    """torch's JIT builds call `c++`: here that is scripts/pch_cxx.py, which precompiles torch's header once
    per flag set (the ranks' later loads see the same commands and find the builds up to date)."""
    real = shutil.which(os.environ.get("CXX", "c++"))
    if real is None or os.environ.get("CXX"):
        return  # a compiler of the user's choice: left alone
    root = Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "dstrain-precompiled-headers"
    front = root / "bin" / "c++"
    front.parent.mkdir(parents=True, exist_ok=True)
    front.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(Path(__file__).with_name('pch_cxx.py')))} \"$@\"\n")
    front.chmod(0o755)
    os.environ.update(DSTRAIN_PCH_REAL_CXX=real, DSTRAIN_PCH_DIR=str(root),
                      PATH=f"{front.parent}{os.pathsep}{os.environ['PATH']}")


def _say(said: list[str], line: str) -> None:
    said.append(line)
    print(line, flush=True)


if __name__ == "__main__":
    main()
