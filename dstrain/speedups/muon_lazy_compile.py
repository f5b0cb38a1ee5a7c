"""DeepSpeed's Muon optimizer imported with its kernels compiled at their first call, not at import
(registry: muon_lazy_compile; switch speedups.muon_lazy_compile).

DeepSpeed 0.19 imports its Muon module in every engine build (the check that ZeRO supports the
optimizer) and in ZeRO-1/2's first gradient reduction, whatever the optimizer. That module decorates
three functions with torch.compile, and torch.compile, even before any call, imports TorchInductor:
about 3 s of CPU in every rank's start. Here the module is imported once, while the engine is built,
with a decorator that makes the same torch.compile(function) at the function's first call. A run with
another optimizer never calls them and never imports Inductor for them; a Muon run compiles them as before.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from contextlib import contextmanager

MUON_MODULES = ("deepspeed.runtime.zero.muon.original_muon", "deepspeed.runtime.zero.muon.muon_optimizer")
_imported_here = False  # whether muon_imported_lazily imported them in this process


def compiled_at_first_call(function):
    """`torch.compile(function)`, made when the returned function is first called."""
    compiled = None

    @functools.wraps(function)
    def call(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            import torch
            compiled = torch.compile(function)
        return compiled(*args, **kwargs)
    return call


@contextmanager
def muon_imported_lazily():
    """Import DeepSpeed's Muon modules with compiled_at_first_call as their torch.compile decorator (the
    registry opens it around deepspeed.initialize; the modules stay imported, so DeepSpeed's own imports
    of them later find them)."""
    global _imported_here
    from deepspeed.runtime import compiler

    original = compiler.compile
    compiler.compile = lambda: compiled_at_first_call
    try:
        for name in MUON_MODULES:
            importlib.import_module(name)
        _imported_here = True
    finally:
        compiler.compile = original
    yield


def applies(engine=None) -> str | None:
    """Why Muon's import cannot be made lazy before an engine build (engine None), or was not for
    `engine` (None: it can, it was)."""
    from deepspeed.runtime import compiler

    if engine is not None:
        return None if _imported_here else "DeepSpeed's Muon module was imported already"
    if any(name in sys.modules for name in MUON_MODULES):
        return "DeepSpeed's Muon module was imported already"
    if not hasattr(compiler, "compile") or importlib.util.find_spec(MUON_MODULES[0]) is None:
        return "this DeepSpeed has no Muon module compiled through deepspeed.runtime.compiler"
    return None
