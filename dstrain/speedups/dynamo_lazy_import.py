"""torch's compiler (torch._dynamo) imported when something compiles, not when the first optimizer is built
(registry: dynamo_lazy_import; switch speedups.dynamo_lazy_import).

torch marks some of its own functions "not to be compiled" with torch._disable_dynamo: the optimizer's
add_param_group, state_dict, load_state_dict and zero_grad, torch.utils.checkpoint's entry points, the
functional optimizers. The mark is made at the function's first call, and making it imports torch._dynamo:
about 1.5 s of CPU, in every rank, at the first optimizer's construction inside deepspeed.initialize, for
a run that never compiles anything. DeepSpeed's ZeRO-3 does the same at once, decorating its module hooks
with torch.compiler.disable while the engine is built.

While torch._dynamo is not imported nothing can be compiling, so those functions are called as they are:
each gets itself as its mark, and torch.compiler.disable, while the engine is built, gives torch's own
first-call form (torch._disable_dynamo, as DeepSpeed's `lazy_disable` does) with the same stand-in. The
first import of torch._dynamo (torch.compile, a user's module, a compiled kernel) removes the stand-ins
at once, and from then on torch makes its marks as it always does. The same functions run either way:
the weights are the same to the bit.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import types
from contextlib import contextmanager

import torch

DYNAMO = "torch._dynamo"
# torch's modules whose marked functions a rank calls (the optimizers DeepSpeed builds subclass
# torch.optim.Optimizer); DeepSpeed's own (its `lazy_disable`: ZeRO-3's parameter coordinator, its activation
# checkpointing) are looked for in every deepspeed module imported before and after the engine build.
MODULES = ("torch.optim.optimizer", "torch.optim.adam", "torch.optim.adamw", "torch.optim.sgd",
           "torch.utils.checkpoint")
_marked: list = []  # the functions given a stand-in, until torch._dynamo is imported


def _inner_code():
    """The code object of torch._disable_dynamo's wrapper (None: this torch has none)."""
    probe = getattr(torch, "_disable_dynamo", None)
    if probe is None:
        return None
    wrapper = probe(lambda: None)
    return getattr(wrapper, "__code__", None)


def _wrapped_functions(code) -> list:
    """Every function of MODULES and the imported deepspeed modules that torch._disable_dynamo wrapped (its
    original, as `fn` in the wrapper), found in the modules' and their classes' namespaces and in closures
    (the functional optimizers' fallback keeps its wrapper in one)."""
    found, seen = [], set()

    def visit(obj) -> None:
        if not isinstance(obj, types.FunctionType) or id(obj) in seen:
            return
        seen.add(id(obj))
        if obj.__code__ is code:
            cells = dict(zip(obj.__code__.co_freevars, obj.__closure__ or ()))
            if "fn" in cells:
                found.append(cells["fn"].cell_contents)
            return
        for cell in obj.__closure__ or ():
            try:
                visit(cell.cell_contents)
            except ValueError:  # an empty cell
                pass

    names = [*MODULES, *(name for name in list(sys.modules) if name.startswith("deepspeed."))]
    for name in names:
        module = sys.modules.get(name) or importlib.import_module(name)
        for value in list(vars(module).values()):
            if isinstance(value, type) and value.__module__ == name:
                for attribute in vars(value).values():
                    visit(attribute)
            else:
                visit(value)
    return found


class _RestoreOnImport(importlib.abc.MetaPathFinder):
    """Removes the stand-ins right after torch._dynamo's module has run, whoever imports it."""

    def find_spec(self, name, path=None, target=None):
        if name != DYNAMO:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            restore()
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            try:
                run(module)
            finally:
                restore()
        spec.loader.exec_module = exec_module
        return spec


def _stand_in(fn) -> bool:
    """Give `fn` (wrapped by torch._disable_dynamo) itself as its mark, until torch._dynamo is imported."""
    if not isinstance(fn, types.FunctionType) or "__dynamo_disable" in fn.__dict__:
        return False
    fn.__dynamo_disable = fn
    _marked.append(fn)
    return True


def _disable_at_first_call(fn=None, recursive=True, *, reason=None):
    """torch.compiler.disable while an engine is built and torch._dynamo is not imported: torch's first-call
    form, with the stand-in mark; torch's own where it cannot be (a callable that is not a plain function)."""
    if fn is None:
        return lambda function: _disable_at_first_call(function, recursive, reason=reason)
    if DYNAMO in sys.modules or not isinstance(fn, types.FunctionType):
        return _ORIGINAL_DISABLE(fn, recursive, reason=reason)
    wrapped = torch._disable_dynamo(fn, recursive)
    _stand_in(fn)
    return wrapped


_ORIGINAL_DISABLE = torch.compiler.disable


def restore() -> None:
    """torch's own behaviour again: the next call of each function makes torch's mark."""
    for fn in _marked:
        fn.__dict__.pop("__dynamo_disable", None)
    _marked.clear()
    for finder in [f for f in sys.meta_path if isinstance(f, _RestoreOnImport)]:
        sys.meta_path.remove(finder)


def applies(engine=None) -> str | None:
    """Why the import cannot be deferred before an engine build (engine None), or was not for `engine`."""
    if engine is not None:
        return None
    if DYNAMO in sys.modules:
        return "torch._dynamo was imported already"
    if _inner_code() is None:
        return "this torch has no torch._disable_dynamo"
    return None


@contextmanager
def dynamo_imported_when_needed():
    """Give each function torch._disable_dynamo wrapped a stand-in mark (itself) while torch._dynamo is not
    imported, and torch.compiler.disable the first-call form while the engine is built (the registry opens
    it around deepspeed.initialize; the stand-ins stay for the process, until torch._dynamo is imported)."""
    if DYNAMO in sys.modules:
        yield
        return
    if not any(isinstance(f, _RestoreOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RestoreOnImport())
    code = _inner_code()
    for fn in _wrapped_functions(code):
        _stand_in(fn)
    torch.compiler.disable = _disable_at_first_call
    try:
        yield
    finally:
        torch.compiler.disable = _ORIGINAL_DISABLE
    if DYNAMO not in sys.modules:  # the modules the engine build imported
        for fn in _wrapped_functions(code):
            _stand_in(fn)
