"""ZeRO-3's host work per step, trimmed without changing what it computes.

DeepSpeed 0.19.8's ZeRO-3 is host-bound on models whose layers are quick to compute: on the 406M GPT on
two H200s the device was busy 55% of a step, and cProfile counted about 230,000 Python calls a step
(docs/benchmarks.md, finding 29). Three of them are plain lookups repeated hundreds of times a step,
each answering the same thing every time:

- `get_accelerator().current_stream()` without a device: torch resolves "the current device" through
  eight Python calls (availability checks, an environment read) on each of ~1,250 calls a step. Here it
  is asked by index (`torch.cuda.current_device()`), which torch returns at once.
- `print_rank_0` in ZeRO-3's modules asks `dist.get_rank()` on each of ~840 calls a step before it
  checks whether it prints at all (only with debug or force). Here it checks first.
- `iter_params(module, recurse=True)` on a fetch unit (a transformer block marked as a ZeRO-3 leaf)
  walks its submodules on every fetch, release and prefetch. The parameters of a module are fixed once
  `deepspeed.initialize` has partitioned them, so each module's answer is kept and read again only when
  its external parameters (which DeepSpeed registers during a forward) change.

The step's arithmetic, its collectives and their order are DeepSpeed's; tests/test_zero3_host.py checks
weights and losses bit for bit against DeepSpeed's own code on two CPU ranks. `DSTRAIN_ZERO3_HOST=off`
leaves DeepSpeed as it is.
"""

from __future__ import annotations

from collections.abc import Mapping

from dstrain.switches import switched_off

# The modules whose global `print_rank_0(message, debug=False, force=False)` is guarded.
_PRINTING_MODULES = ("deepspeed.runtime.zero.partition_parameters", "deepspeed.runtime.zero.stage3",
                     "deepspeed.runtime.zero.linear", "deepspeed.runtime.zero.partitioned_param_coordinator",
                     "deepspeed.runtime.zero.parameter_offload")
# The modules that call `iter_params` through their own global name.
_ITER_PARAMS_MODULES = ("deepspeed.runtime.zero.partitioned_param_coordinator",
                        "deepspeed.runtime.zero.parameter_offload")
_INSTALLED: list[str] = []


def trim_zero3_host_work(env: Mapping[str, str], accelerator: str) -> list[str]:
    """Install the trims (once per process; before `deepspeed.initialize`, so that zero.Init gains
    too); returns what was installed, nothing when switched off."""
    if switched_off(env, "DSTRAIN_ZERO3_HOST"):
        return []
    if _INSTALLED:
        return list(_INSTALLED)
    import importlib
    if accelerator == "cuda" and _stream_by_index():
        _INSTALLED.append("current stream by device index")
    guarded = [name for name in _PRINTING_MODULES if _guard_print(importlib.import_module(name))]
    if guarded:
        _INSTALLED.append("print_rank_0 without a rank lookup")
    if all(_remember_params(importlib.import_module(name)) for name in _ITER_PARAMS_MODULES):
        _INSTALLED.append("each fetch unit's parameters remembered")
    return list(_INSTALLED)


def _stream_by_index() -> bool:
    import torch
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    def current_stream(self, device_index=None):
        return torch.cuda.current_stream(torch.cuda.current_device() if device_index is None else device_index)

    def default_stream(self, device_index=None):
        return torch.cuda.default_stream(torch.cuda.current_device() if device_index is None else device_index)

    CUDA_Accelerator.current_stream = current_stream
    CUDA_Accelerator.default_stream = default_stream
    return True


def _guard_print(module) -> bool:
    original = getattr(module, "print_rank_0", None)
    if original is None or getattr(original, "_dstrain_guarded", False):
        return False
    import inspect
    if list(inspect.signature(original).parameters) != ["message", "debug", "force"]:
        return False  # another DeepSpeed's helper: leave it

    def print_rank_0(message, debug=False, force=False):
        if debug or force:  # DeepSpeed's prints only then (and on rank 0)
            original(message, debug, force)

    print_rank_0._dstrain_guarded = True
    module.print_rank_0 = print_rank_0
    return True


def _remember_params(module) -> bool:
    original = getattr(module, "iter_params", None)
    if original is None:
        return False
    if getattr(original, "_dstrain_remembers", False):
        return True
    import torch

    def iter_params(sub_module, recurse=False):
        if torch.compiler.is_compiling():  # traced code keeps DeepSpeed's own walk
            return original(sub_module, recurse)
        external = getattr(sub_module, "_external_params", None)
        registered = tuple(external) if external else ()
        memo = sub_module.__dict__.setdefault("_dstrain_params", {})  # recurse -> (registered, params)
        kept = memo.get(recurse)
        if kept is not None and kept[0] == registered:
            return kept[1]
        params = tuple(original(sub_module, recurse))
        memo[recurse] = (registered, params)
        return params

    iter_params._dstrain_remembers = True
    module.iter_params = iter_params
    return True
