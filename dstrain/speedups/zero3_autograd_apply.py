"""ZeRO-3: DeepSpeed's autograd Functions applied without torch's per-call signature binding (registry:
zero3_autograd_apply).

ZeRO-3 runs three kinds of torch.autograd.Function in every forward: its linear (each nn.Linear goes
through LinearFunctionForZeroStage3 while memory_efficient_linear is on, DeepSpeed's default) and each
hooked module's pre- and post-backward Functions. They define setup_context, so torch's Function.apply
binds every call's arguments to forward's signature with inspect.signature, rebuilt at each call: about
150 of them a micro step at 1.65B, 1,264 in a profiled step of eight, 0.1 ms each
(benchmarks/results/2026-11-27-h200-offload-host/).

Here those classes' apply skips the binding where it is the identity, every positional argument given
and no keyword (how DeepSpeed calls them), and otherwise goes through torch's own apply. The same
forward, setup_context and backward run: the values are DeepSpeed's.
"""

from __future__ import annotations

import inspect

_FUNCTION_APPLY = None  # torch's Function.apply (its function), for the calls the fast path leaves to it


def applies(engine) -> str | None:
    """Why the lean apply does not cover `engine` (None: it does): ZeRO-3 with DeepSpeed's module hooks
    or linear Function, on a torch whose Function.apply is the one it replaces."""
    import torch
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    if not isinstance(getattr(engine, "optimizer", None), DeepSpeedZeroOptimizer_Stage3):
        return "not ZeRO-3"
    if not isinstance(torch.autograd.Function.__dict__.get("apply"), classmethod):
        return "this torch's Function.apply is not a classmethod"
    for name in ("_are_functorch_transforms_active",):
        if not hasattr(torch._C, name):
            return f"this torch lacks torch._C.{name}"
    try:
        from torch._functorch.utils import unwrap_dead_wrappers  # noqa: F401
    except ImportError:
        return "this torch lacks torch._functorch.utils.unwrap_dead_wrappers"
    if not _functions(engine):
        return "no DeepSpeed autograd Functions with setup_context"
    return None


def _functions(engine) -> list:
    """DeepSpeed's Function classes this engine's forward applies: the ZeRO-3 linear and each module's
    pre- and post-backward classes, those that define setup_context (the ones torch binds)."""
    import torch

    found = []
    try:
        from deepspeed.runtime.zero.linear import LinearFunctionForZeroStage3
        found.append(LinearFunctionForZeroStage3)
    except ImportError:
        pass
    for module in engine.module.modules():
        for name in ("pre_bwd_fn", "post_bwd_fn"):
            cls = module.__dict__.get(name)
            if cls is not None:
                found.append(cls)
    return [cls for cls in found if isinstance(cls, type) and issubclass(cls, torch.autograd.Function)
            and "setup_context" in cls.__dict__ and _arity(cls) is not None]


def _arity(cls) -> int | None:
    """forward's parameter count where every parameter is a plain positional one (None otherwise)."""
    parameters = inspect.signature(cls.forward).parameters.values()
    if any(p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD for p in parameters):
        return None
    return len(parameters)


def install(engine, state) -> str | None:
    """Give DeepSpeed's Function classes of `engine` the lean apply (class attributes: the linear's is
    process-wide, as DeepSpeed's class is)."""
    import torch

    global _FUNCTION_APPLY
    if _FUNCTION_APPLY is None:
        _FUNCTION_APPLY = torch.autograd.Function.__dict__["apply"].__func__
    for cls in _functions(engine):
        cls._dstrain_arity = _arity(cls)
        cls.apply = classmethod(_apply)
    return None


def _apply(cls, *args, **kwargs):
    """torch's Function.apply where binding `args` to forward's signature would change nothing: all of
    forward's parameters given by position. Anything else (keywords, defaults to fill, functorch
    transforms) goes through torch's apply."""
    import torch
    from torch._functorch.utils import unwrap_dead_wrappers

    if kwargs or len(args) != cls._dstrain_arity or torch._C._are_functorch_transforms_active():
        return _FUNCTION_APPLY(cls, *args, **kwargs)
    return super(torch.autograd.Function, cls).apply(*unwrap_dead_wrappers(args))
