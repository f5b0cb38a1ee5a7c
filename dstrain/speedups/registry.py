"""Every change dstrain makes to DeepSpeed's internals, registered once: its name, the DeepSpeed code it
replaces, its switch in the config's `speedups:` section, why it may not apply, what it needs first, and
the DeepSpeed versions its bit-identity tests passed on. `apply` and `building_engine` are the only
ways in; on a DeepSpeed outside the verified versions they change nothing and say so once."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dstrain.speedups import (cpu_adam_nogil, cuda_stream, dynamo_lazy_import, offload_accumulate_zero3, offload_accumulate_zero12,
                              offload_chunked_step, offload_chunked_step_zero3, offload_fetch_wait, offload_grads_zero3,
                              offload_keep_weights, offload_overlap_zero3, offload_syncs, muon_lazy_compile,
                              zero3_flatten, zero3_grads, zero3_step, zero3_unhook)
from dstrain.speedups.state import SpeedupState, ensure_state

# The DeepSpeed releases on which every change's bit-identity tests passed (tests/test_zero3_step.py,
# test_offload_step_zero3.py, test_offload_syncs.py, test_zero3_flatten.py, and the offload launcher test
# of test_run.py). A release is added here only after those tests pass on it.
VERIFIED = ("0.19.8",)

NO_ACCUMULATION = "no gradient accumulation"  # the reason of the changes that only accumulating runs need
ENGINE_BUILD = "engine build"  # applied around deepspeed.initialize (building_engine)
ENGINE = "engine"  # applied to the built engine (apply)
_built: set[str] = set()  # the ENGINE_BUILD changes building_engine made in this process


@dataclass(frozen=True)
class Speedup:
    name: str
    """The registry's name of the change (also docs/performance.md's)."""
    replaces: tuple[str, ...]
    """The DeepSpeed code it replaces, by qualified name."""
    switch: str
    """Its field in the config's `speedups:` section (dstrain/config/schema.py: SpeedupsConfig)."""
    applies: Callable[[Any], str | None]
    """applies(engine): why it does not cover this engine's set-up, in a few words; None where it does."""
    install: Callable[[Any, Any, SpeedupState], Any]
    """install(engine, settings, state): make the change; a reason where it still could not (nothing changed).
    For an ENGINE_BUILD change, install(None, settings, None) is entered as a context manager around
    deepspeed.initialize."""
    summary: str | Callable[[SpeedupState], str]
    """What rank 0 says it did."""
    family: str
    """The line of rank 0's summary it is named in."""
    requires: tuple[str, ...] = ()
    """Changes that must have applied first (by name)."""
    verified_on: tuple[str, ...] = VERIFIED
    """DeepSpeed versions its bit-identity tests passed on."""
    phase: str = ENGINE
    on_demand: bool = False
    """Installed only when a change that requires it is installed (a build that takes a minute)."""
    on_value: Any = None
    """The switch's value that turns it on, where the switch is not a plain on/off."""

    def switched_on(self, settings) -> bool:
        value = getattr(settings, self.switch)
        return value == self.on_value if self.on_value is not None else value not in (False, "off")

    def off_reason(self, settings) -> str:
        value = getattr(settings, self.switch)
        shown = str(value).lower() if isinstance(value, bool) else value
        return f"speedups.{self.switch}={shown}"

    def describe(self, state: SpeedupState) -> str:
        return self.summary(state) if callable(self.summary) else self.summary


def _gradient_copy(state: SpeedupState) -> str:
    return f"gradients sent to the host once, in {'bf16' if state.bf16_grads is not None else 'fp32'}"


def _chunked_zero3(engine, settings, state: SpeedupState) -> None:
    round_op = None
    if settings.offload_host_rounding and offload_chunked_step_zero3.rounds_on_host(engine) is None:
        round_op = _adam_op(engine, settings, state)
    offload_chunked_step_zero3.install(engine, state, settings.offload_chunk_elements, round_op)


def _adam_op(engine, settings, state: SpeedupState):
    """dstrain's Adam op, built through its registry entry (once) where it is switched on and applies."""
    entry = BY_NAME["cpu_adam_nogil"]
    if entry.name not in state.applied and entry.name not in state.refused and entry.switched_on(settings):
        _try(entry, engine, settings, state)
    return state.adam_op


def _round_in_adam_pass(engine, settings, state: SpeedupState) -> str | None:
    if state.round_op is None:
        return "dstrain's Adam op is not available"
    return None


REGISTRY: tuple[Speedup, ...] = (
    Speedup("cuda_stream", ("deepspeed.accelerator.cuda_accelerator.CUDA_Accelerator.current_stream",),
            "cuda_stream", cuda_stream.applies, lambda engine, settings, state: cuda_stream.installed(),
            "the current stream looked up by device index", "CUDA", phase=ENGINE_BUILD),
    Speedup("muon_lazy_compile", ("deepspeed.runtime.compiler.compile (while DeepSpeed's Muon module is imported)",),
            "muon_lazy_compile", muon_lazy_compile.applies,
            lambda engine, settings, state: muon_lazy_compile.muon_imported_lazily(),
            "Muon's kernels compiled at first use, not at import", "Engine build", phase=ENGINE_BUILD),
    Speedup("dynamo_lazy_import", ("deepspeed.runtime.zero.parameter_offload.DeepSpeedZeRoOffload._register_deepspeed_module"
                                   " (its torch.compiler.disable, while the engine is built)",
                                   "deepspeed.runtime.compiler.lazy_disable's marks, and torch.optim's and "
                                   "torch.utils.checkpoint's (torch._disable_dynamo), while torch._dynamo is not imported"),
            "dynamo_lazy_import", dynamo_lazy_import.applies,
            lambda engine, settings, state: dynamo_lazy_import.dynamo_imported_when_needed(),
            "torch's compiler imported when something compiles", "Engine build", phase=ENGINE_BUILD),
    Speedup("cpu_adam_nogil", ("deepspeed.ops.adam.DeepSpeedCPUAdam.ds_opt_adam (its binding, for dstrain's updates)",),
            "cpu_adam_nogil", cpu_adam_nogil.applies,
            lambda engine, settings, state: cpu_adam_nogil.install(engine, state),
            "DeepSpeed's CPU Adam kernel built with a GIL-free binding", "CPU offload", on_demand=True),
    Speedup("offload_syncs", ("deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer.update_offload_overflow_tracker",
                              "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer.complete_grad_norm_calculation_for_cpu_offload"),
            "offload_syncs", offload_syncs.applies, lambda engine, settings, state: offload_syncs.install(engine, state),
            "no per-parameter GPU waits in the backward", "CPU offload"),
    Speedup("offload_grads_zero3", ("deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3.partition_grads",),
            "offload_grads", offload_grads_zero3.applies,
            lambda engine, settings, state: offload_grads_zero3.install(engine, state),
            _gradient_copy, "CPU offload"),
    Speedup("offload_chunks", ("deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer.step",),
            "offload_chunks", offload_chunked_step.applies,
            lambda engine, settings, state: offload_chunked_step.install(engine, state, settings.offload_chunk_elements),
            "optimizer step in chunks", "CPU offload"),
    Speedup("offload_chunks_zero3", ("deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3.step",),
            "offload_chunks", offload_chunked_step_zero3.applies, _chunked_zero3,
            "optimizer step in chunks", "CPU offload"),
    Speedup("offload_host_rounding", ("deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3.step "
                                      "(the bf16 rounding pass of the chunked step)",),
            "offload_host_rounding", offload_chunked_step_zero3.rounds_on_host, _round_in_adam_pass,
            "bf16 weights rounded in the Adam pass", "CPU offload",
            requires=("offload_chunks_zero3", "cpu_adam_nogil")),
    Speedup("offload_bf16_grads", ("deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer."
                                   "async_inplace_copy_grad_to_fp32_buffer_from_gpu",),
            "offload_grads", offload_chunked_step.bf16_grads_apply,
            lambda engine, settings, state: offload_chunked_step.install_bf16_grads(engine, state),
            "gradients sent to the host in bf16", "CPU offload", requires=("offload_chunks", "cpu_adam_nogil"),
            on_value="bf16"),
    Speedup("offload_bf16_grads_zero3", ("deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3.partition_grads "
                                         "(offload_grads_zero3's copy, in bf16)",),
            "offload_grads", offload_grads_zero3.bf16_grads_apply,
            lambda engine, settings, state: offload_grads_zero3.install_bf16_grads(engine, state),
            "", "CPU offload", requires=("offload_grads_zero3", "offload_chunks_zero3", "cpu_adam_nogil"),
            on_value="bf16"),
    Speedup("offload_accumulate_zero12", ("deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer."
                                          "async_accumulate_grad_in_cpu_via_gpu",),
            "offload_accumulate", offload_accumulate_zero12.applies,
            lambda engine, settings, state: offload_accumulate_zero12.install(
                engine, state, auto=settings.offload_accumulate == "auto"),
            offload_accumulate_zero3.describe, "CPU offload"),
    Speedup("offload_accumulate_zero3", ("deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3.partition_grads "
                                         "(the micro steps that accumulate, through offload_grads_zero3's)",),
            "offload_accumulate", offload_accumulate_zero3.applies,
            lambda engine, settings, state: offload_accumulate_zero3.install(
                engine, state, auto=settings.offload_accumulate == "auto"),
            offload_accumulate_zero3.describe, "CPU offload", requires=("offload_grads_zero3",)),
    Speedup("offload_overlap", ("deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3.step",
                                "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3.partition_grads",
                                "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3.state_dict",
                                "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3.load_state_dict",
                                "deepspeed.runtime.engine.DeepSpeedEngine.save_checkpoint",
                                "deepspeed.runtime.engine.DeepSpeedEngine.load_checkpoint",
                                "deepspeed.runtime.zero.partition_parameters: each parameter's all_gather "
                                "and all_gather_coalesced"),
            "offload_overlap", offload_overlap_zero3.applies,
            lambda engine, settings, state: offload_overlap_zero3.install(
                engine, state, settings.offload_overlap_threads, settings.offload_gil_handoff),
            "the step beside the next forward", "CPU offload", requires=("offload_chunks_zero3", "cpu_adam_nogil")),
    Speedup("offload_fetch_wait", ("deepspeed.runtime.zero.partition_parameters.NoGatherHandle.wait",
                                   "deepspeed.runtime.zero.partition_parameters.NoGatherCoalescedHandle.wait"),
            "offload_fetch_wait", offload_fetch_wait.applies,
            lambda engine, settings, state: offload_fetch_wait.install(engine, state),
            "fetched parameters waited for by the GPU, not the host", "CPU offload"),
    Speedup("offload_keep_weights", ("deepspeed.runtime.zero.partitioned_param_coordinator."
                                     "PartitionedParameterCoordinator.__release_param (inside an accumulation window)",
                                     "deepspeed.runtime.zero.partitioned_param_coordinator."
                                     "PartitionedParameterCoordinator.release_and_reset_all"),
            "offload_keep_weights", offload_keep_weights.applies,
            lambda engine, settings, state: offload_keep_weights.install(
                engine, state, auto=settings.offload_keep_weights == "auto"),
            offload_keep_weights.describe, "CPU offload"),
    Speedup("zero3_step", ("deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3.step",),
            "zero3_step", zero3_step.applies, lambda engine, settings, state: zero3_step.install(engine, state),
            "the step's release, gradient norm and persistent gather batched", "ZeRO-3"),
    Speedup("zero3_gather", ("deepspeed.runtime.zero.partition_parameters: all_gather_coalesced of the "
                             "persistent parameters after the step",),
            "zero3_gather", lambda engine: None,
            lambda engine, settings, state: setattr(state, "lean_gather", True),
            "the persistent parameters' gather regrouped in one copy", "ZeRO-3", requires=("zero3_step",)),
    Speedup("zero3_hooks", ("deepspeed.runtime.zero.parameter_offload.DeepSpeedZeRoOffload's module hooks",),
            "zero3_hooks", zero3_unhook.applies, lambda engine, settings, state: zero3_unhook.install(engine, state),
            lambda state: f"no module hooks on {state.unhooked} modules whose parameters stay gathered", "ZeRO-3",
            requires=("zero3_step",)),
    Speedup("zero3_grads", ("deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3."
                            "reduce_independent_p_g_buckets_and_remove_grads",
                            "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3.partition_grads",
                            "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3."
                            "independent_gradient_partition_epilogue"),
            "zero3_grads", zero3_grads.applies, lambda engine, settings, state: zero3_grads.install(engine, state),
            "the backward's gradient copies lean", "ZeRO-3", requires=("zero3_step",)),
    Speedup("zero3_flatten", ("deepspeed.runtime.zero.stage3.defragment",), "flatten_on_device",
            zero3_flatten.applies, lambda engine, settings, state: zero3_flatten.partitions_flattened_on_device(),
            "the partitions flattened on the device at engine start", "ZeRO-3", phase=ENGINE_BUILD),
)
BY_NAME = {entry.name: entry for entry in REGISTRY}


@dataclass
class Report:
    """What apply did, for rank 0 to print."""

    applied: list[str] = field(default_factory=list)
    not_applied: dict[str, str] = field(default_factory=dict)
    """Name -> why, for every change that did not apply (switched off included)."""
    warning: str | None = None
    """Set where the DeepSpeed version is outside the verified ones: nothing was changed."""
    state: SpeedupState | None = None

    def lines(self) -> list[str]:
        """One line per family of applied changes, then one per reason a change of such a family (or one switched
        off) did not apply; changes that did not apply because a prerequisite did not are named on their
        prerequisite's line."""
        if self.warning:
            return [f"warning: {self.warning}"]
        lines = []
        for family in dict.fromkeys(entry.family for entry in REGISTRY):
            parts = [entry.describe(self.state) for entry in REGISTRY
                     if entry.family == family and entry.name in self.applied]
            parts = [part for part in parts if part]
            if parts:
                lines.append(f"{family}, dstrain's changes: " + "; ".join(parts))
        # A family none of whose changes applied does not fit this run (ZeRO-3's changes at stage 2, say):
        # silent, unless the user switched a change off.
        fitting = {BY_NAME[name].family for name in self.applied}
        by_reason: dict[str, list[str]] = {}
        for name, reason in self.not_applied.items():
            if BY_NAME[name].family not in fitting and not reason.startswith("speedups."):
                continue
            if reason == NO_ACCUMULATION:  # a change for accumulating runs: nothing to say to one that does not
                continue
            # a change whose prerequisite did not apply goes on the line of the first one missing
            while reason.startswith("needs ") and reason.removeprefix("needs ").split(",")[0] in self.not_applied:
                reason = self.not_applied[reason.removeprefix("needs ").split(",")[0]]
            by_reason.setdefault(reason, []).append(name)
        for reason, names in by_reason.items():
            lines.append(f"not applied: {', '.join(names)} ({reason})")
        return lines


def unverified(version: str | None = None) -> str | None:
    """The warning where DeepSpeed `version` (default: the installed one) is outside every change's verified
    versions; None where it is inside."""
    if version is None:
        import deepspeed
        version = deepspeed.__version__
    verified = sorted({v for entry in REGISTRY for v in entry.verified_on})
    if version in verified:
        return None
    return (f"DeepSpeed {version} is not a version dstrain's speed-ups were verified on ({', '.join(verified)}): "
            "all of them are skipped and stock DeepSpeed trains")


def _settings(settings):
    if settings is None:
        from dstrain.config.schema import SpeedupsConfig
        return SpeedupsConfig()
    return settings


@contextlib.contextmanager
def building_engine(settings=None, deepspeed_version: str | None = None):
    """Open around deepspeed.initialize: the changes that act while the engine is built (ENGINE_BUILD)."""
    settings = _settings(settings)
    if unverified(deepspeed_version):
        yield
        return
    with contextlib.ExitStack() as stack:
        for entry in REGISTRY:
            if entry.phase != ENGINE_BUILD or not entry.switched_on(settings) or entry.applies(None) is not None:
                continue
            stack.enter_context(entry.install(None, settings, None))
            _built.add(entry.name)
        yield


def apply(engine, settings=None, only: tuple[str, ...] | None = None, deepspeed_version: str | None = None) -> Report:
    """Apply every change that is switched on in `settings` (the config's speedups section; default: the
    schema's defaults) and covers `engine`, in the registry's order; `only`: just these (by name).
    `deepspeed_version`: the version to check against VERIFIED (default: the installed one)."""
    settings = _settings(settings)
    report = Report()
    warning = unverified(deepspeed_version)
    if warning:
        report.warning = warning
        report.not_applied = {entry.name: "DeepSpeed version not verified" for entry in REGISTRY}
        return report
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is None:
        report.not_applied = {entry.name: "the engine has no optimizer" for entry in REGISTRY}
        return report
    state = ensure_state(optimizer)
    report.state = state
    for entry in REGISTRY:
        if only is not None and entry.name not in only:
            continue
        if entry.name in state.applied or entry.name in state.refused:
            continue
        if entry.phase == ENGINE_BUILD:
            reason = entry.off_reason(settings) if not entry.switched_on(settings) else entry.applies(engine)
            if reason is None and entry.name not in _built:
                reason = "the engine was built outside speedups.building_engine"
            if reason is None:
                state.applied.append(entry.name)  # building_engine applied it
            else:
                state.refused[entry.name] = reason
            continue
        if not entry.switched_on(settings):
            state.refused[entry.name] = entry.off_reason(settings)
            continue
        if entry.on_demand:
            continue  # installed by what needs it
        _try(entry, engine, settings, state)
    report.applied = list(state.applied)
    report.not_applied = {name: reason for name, reason in state.refused.items()
                          if only is None or name in only}
    return report


def _try(entry: Speedup, engine, settings, state: SpeedupState) -> None:
    """Install `entry` where its prerequisites applied and it covers `engine`; record why not otherwise. An
    on-demand prerequisite (a build) is made only once everything else says yes."""
    waiting = [name for name in entry.requires if name not in state.applied and not BY_NAME[name].on_demand]
    reason = ("needs " + ", ".join(waiting)) if waiting else entry.applies(engine)
    if reason is None:
        for name in entry.requires:
            needed = BY_NAME[name]
            if needed.on_demand and name not in state.applied and name not in state.refused:
                if needed.switched_on(settings):
                    _try(needed, engine, settings, state)
                else:
                    state.refused[name] = needed.off_reason(settings)
        missing = [name for name in entry.requires if name not in state.applied]
        reason = ("needs " + ", ".join(missing)) if missing else entry.install(engine, settings, state)
    if reason is None:
        state.applied.append(entry.name)
    else:
        state.refused[entry.name] = reason
