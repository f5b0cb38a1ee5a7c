"""The train loop: engine(batch) -> engine.backward(loss) -> engine.step(), with evaluation,
logging and checkpoints when they are due, and a clean stop on SIGTERM/SIGINT. Evaluation
(rank/evaluation.py) and checkpointing (rank/checkpointing.py) each say when they are due and keep their
own state (early stopping's count, the save clock); the loop asks them.

Everything that needs the host to wait for the device (loss values, timing) happens only at
log steps, so the loop adds nothing to the critical path between them. The stop request (and a
time-based save, train.save_every_minutes) is agreed by all ranks through an asynchronous
all-reduce on a CPU (gloo) group, issued one step and read the next, so every rank stops and
saves at the same step without a GPU sync. The run health guard (dstrain/rank/health.py) judges
the steps at every step that logs, evaluates or saves, before it does, and may roll back.
"""

from __future__ import annotations

import contextlib
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from dstrain.config.schema import RunConfig
from dstrain.data.sampler import rank_batch, to_device
from dstrain.data.sequence import Layout
from dstrain.rank import heartbeat
from dstrain.rank.checkpointing import Checkpointer
from dstrain.rank.evaluation import Evaluator
from dstrain.rank.health import Guard, HealthState, RunUnhealthy
from dstrain.rank.metrics import MetricsLog, engine_stats
from dstrain.rank.preference import PreferenceMetrics, micro_batch_weight
from dstrain.rank.profiling import StepProfiler, phase


@dataclass
class StopRequest:
    """Set by the signal handler; agreed across ranks by `StopVote`."""

    signal_name: str | None = None

    def install(self) -> None:
        def handler(signum, _frame):
            self.signal_name = signal.Signals(signum).name
        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)


@dataclass
class StopVote:
    """All ranks learn at the same step whether any rank was asked to stop (the result) and whether
    any rank's save clock is due (`save_due`, set by `result`)."""

    group: Any
    pending: Any = None
    flag: torch.Tensor = field(default_factory=lambda: torch.zeros(2))
    save_due: bool = False

    def cast(self, requested: bool, save_due: bool = False) -> None:
        self.flag = torch.tensor([1.0 if requested else 0.0, 1.0 if save_due else 0.0])
        self.pending = dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)

    def result(self) -> bool:
        self.save_due = False
        if self.pending is None:
            return False
        self.pending.wait()
        self.pending = None
        self.save_due = bool(self.flag[1].item() > 0)
        return bool(self.flag[0].item() > 0)


@dataclass
class LoopState:
    step: int
    stopped_by: str | None = None
    early_stopped: bool = False


@dataclass
class LoopParts:
    """What the loop drives besides the engine: the data, where it logs, and the parts that decide for
    themselves when they are due (the health guard, evaluation, checkpointing)."""

    train_sampler: Any
    device: Any
    metrics: MetricsLog
    guard: Guard
    evaluator: Evaluator
    checkpointer: Checkpointer
    activations: Callable[[], Any] = contextlib.nullcontext
    """The context each micro batch's forward and backward run in (train.activation_checkpointing_offload:
    dstrain.rank.runtime.activation_offload)."""
    profiler: StepProfiler | None = None
    """torch.profiler around profile.steps steps (None: this rank does not profile)."""
    preference: PreferenceMetrics | None = None
    """A preference objective's metrics since the last log line (None: train.objective lm)."""
    router: Any = None
    """A mixture-of-experts model's balancing loss and experts' load since the last log line
    (dstrain.models.moe.RouterStats; None for other models)."""

    @classmethod
    def build(cls, engine, config: RunConfig, run_dir: Path, train_sampler, eval_sampler, device, metrics: MetricsLog,
              client_state: Callable[[int], dict], restored: dict | None) -> "LoopParts":
        """The parts for a run from scratch, or resumed from a checkpoint whose client state is `restored`:
        the guard's health record and early stopping's count continue from it, and travel in every save."""
        restored = restored or {}
        health = HealthState.on_resume(restored.get("health"), run_dir) if restored else HealthState()
        guard = Guard(config, run_dir, dist.get_rank(), dist.get_world_size(), device, health, metrics)
        evaluator = Evaluator(engine, config, eval_sampler, device, metrics, restored.get("early_stop"))
        checkpointer = Checkpointer(engine, run_dir, config.train, lambda step: {
            **client_state(step), "health": health.client_state(), "early_stop": evaluator.early.client_state()})
        from dstrain.rank.runtime import activation_offload
        preference = PreferenceMetrics(config.train.objective, device) if config.train.objective != "lm" else None
        router = getattr(engine.module, "router_stats", None)
        if router is not None:  # its sums meet the other ranks' on this device (NCCL on GPUs)
            router.device = device
        return cls(train_sampler, device, metrics, guard, evaluator, checkpointer, activation_offload(config),
                   StepProfiler.build(config, run_dir, dist.get_rank()), preference, router)


@dataclass
class LogWindow:
    """The steps since the last log line: their summed loss (a device tensor, added without a sync),
    their count, training time, host time building batches and the non-pad tokens trained on."""

    loss_sum: torch.Tensor
    steps: int = 0
    data_s: float = 0.0
    real_tokens: int | None = 0
    """Non-pad tokens trained on (counted on rank 0; None: the sampler cannot tell)."""
    start: float = field(default_factory=time.perf_counter)

    def add(self, step_loss: torch.Tensor, data_s: float, real_tokens: int | None = 0) -> None:
        self.loss_sum += step_loss
        self.steps += 1
        self.data_s += data_s
        self.real_tokens = None if self.real_tokens is None or real_tokens is None else self.real_tokens + real_tokens

    def restart(self) -> None:
        self.loss_sum.zero_()
        self.steps, self.data_s, self.real_tokens, self.start = 0, 0.0, 0, time.perf_counter()

    def skip_time(self) -> None:
        """Evaluation and saving are not training throughput: the window's clock starts again."""
        self.start = time.perf_counter()


def train(engine, config: RunConfig, parts: LoopParts, start_step: int, stop: StopRequest) -> LoopState:
    """Train from start_step to train.max_steps."""
    t = config.train
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = Layout.of(rank, world, t.sequence_parallel)  # which samples, and which of their tokens
    guard, evaluator, checkpointer, metrics = parts.guard, parts.evaluator, parts.checkpointer, parts.metrics
    vote = StopVote(dist.new_group(backend="gloo"))
    state = LoopState(step=start_step)
    # Training mode from the first step: a model loaded by from_pretrained comes in eval mode (no
    # dropout), one built under zero.Init in training mode; evaluation switches back and forth.
    engine.train()
    window = LogWindow(torch.zeros((), device=parts.device))
    metrics.start(start_step)

    while state.step < t.max_steps:
        lr = engine.optimizer.param_groups[0]["lr"]  # get_lr() warns before the first step
        data_step = guard.data_step(state.step)
        if parts.profiler:
            parts.profiler.step_begins()
        step_loss, fetch_s = _optimizer_step(engine, t, parts.train_sampler, data_step, state.step, layout,
                                             parts.device, parts.activations, parts.preference)
        if parts.profiler:
            _say(metrics, parts.profiler.step_ended())
        # a pure function of the sample indices: no collective needed, rank 0 counts
        real_tokens = (parts.train_sampler.real_tokens(data_step * t.global_batch_size, t.global_batch_size)
                       if rank == 0 else 0)
        window.add(step_loss, fetch_s, real_tokens)
        state.step += 1
        guard.record(state.step, step_loss, engine.get_global_grad_norm())
        if vote.result():
            state.stopped_by = stop.signal_name or "a signal on another rank"
        clock_agreed = vote.save_due  # agreed by all ranks; this step's save resets every clock
        vote.cast(stop.signal_name is not None, checkpointer.clock_due() and not clock_agreed)
        stopping = state.stopped_by is not None
        logs = state.step % t.log_every == 0 or state.step == t.max_steps or stopping
        evals = evaluator.should_evaluate(state.step, stopping)
        saves = checkpointer.should_save(state.step, stopping, clock_agreed)

        heartbeat.beat("log")  # the stop vote, the health check and the loss all-reduce are collectives too
        verdict = guard.check() if logs or evals or saves else None
        if verdict is not None:  # nothing of the bad steps is logged, evaluated or saved
            heartbeat.beat("save")  # loading a checkpoint back: a save's allowance
            try:
                state.step = guard.recover(engine, verdict, state.step)
            except RunUnhealthy:
                # The stop vote cast above is still in flight: a process that exits with a gloo
                # operation pending aborts in its destructor ("terminate called ..."), exit -6.
                vote.result()
                metrics.close()
                raise
            metrics.rewind(state.step)  # trackers hide the steps trained again
            window.restart()
            if parts.preference is not None:
                parts.preference.reset()
            if parts.router is not None:
                parts.router.reset()
            if stopping:  # the checkpoint rolled back to is the one to resume from
                break
            continue
        if logs:
            dist.all_reduce(window.loss_sum)  # mean over ranks: every rank logs the same number
            loss_value = window.loss_sum.item() / (world * t.grad_accum_steps * window.steps)
            stats = engine_stats(engine)
            if parts.preference is not None:  # a collective too: rewards/*, logps/* over the window's pairs
                stats.update(parts.preference.reduce())
            if parts.router is not None:  # a collective too: lm_loss, aux_loss, expert_load over all ranks
                stats.update(parts.router.reduce())
            metrics.log_step(state.step, loss_value, lr, time.perf_counter() - window.start, window.steps,
                             window.data_s, stats, window.real_tokens)
            window.restart()
        if evals:
            state.early_stopped = evaluator.run(state.step, stopping)
            window.skip_time()
        if saves or checkpointer.should_save(state.step, stopping, clock_agreed, state.early_stopped):
            saved = checkpointer.save(state.step)
            metrics.note(f"checkpoint {saved.name} saved")
            window.skip_time()
        if stopping or state.early_stopped:
            break
    vote.result()  # leave no collective in flight
    if parts.profiler:  # a run that stopped inside the profiled steps
        _say(metrics, parts.profiler.finish())
    metrics.finish(state, saved_checkpoint=t.save_checkpoints)
    return state


def _say(metrics: MetricsLog, lines: list[str]) -> None:
    """The profile's summary: rank 0's MetricsLog prints it (the others' is in their summary files)."""
    for line in lines:
        metrics.note(line)


def _optimizer_step(engine, t, train_sampler, data_step: int, step: int, layout: Layout, device,
                    activations: Callable[[], Any] = contextlib.nullcontext,
                    preference: PreferenceMetrics | None = None):
    """One optimizer step over train.grad_accum_steps micro-batches: (the summed loss, a device tensor
    nothing waits for; host seconds spent building batches). A preference objective's micro batch loss is
    weighted by its share of the step's pairs (dstrain.rank.preference) and its metrics collected."""
    step_loss = torch.zeros((), device=device)
    fetch_s = 0.0
    if preference is not None:  # the step's pairs over all ranks: a pure function of the sample indices
        step_units = train_sampler.examples(data_step * t.global_batch_size, t.global_batch_size)
    for micro_step in range(t.grad_accum_steps):
        heartbeat.beat("data", step + 1)
        fetch_start = time.perf_counter()
        batch = to_device(layout.share(rank_batch(train_sampler, data_step, micro_step, layout.data_rank,
                                                  layout.data_world, t.micro_batch_size, t.grad_accum_steps)), device)
        fetch_s += time.perf_counter() - fetch_start
        with activations():  # spans forward and backward: what forward offloads, backward brings back
            heartbeat.beat("forward")
            with phase("forward"):
                loss = engine(batch)
            if preference is not None:
                loss = loss * micro_batch_weight(batch, step_units, t.grad_accum_steps * layout.data_world)
                preference.add(engine.module.preference.last_metrics)
            heartbeat.beat("backward")
            with phase("backward"):
                engine.backward(loss)
        heartbeat.beat("step")
        # Outside autograd: DeepSpeed 0.18's ZeRO-1/2 step all-gathers into views of a flat buffer, which
        # torch 2.13 refuses to write in place while grad mode is on (gloo); 0.19's step is the same either way.
        with torch.no_grad(), phase("step"):
            engine.step()
        step_loss += loss.detach().float()
    return step_loss, fetch_s
