"""The train loop: engine(batch) -> engine.backward(loss) -> engine.step(), with evaluation,
logging and checkpoints at their intervals, and a clean stop on SIGTERM/SIGINT.

Everything that needs the host to wait for the device (loss values, timing) happens only at
log steps, so the loop adds nothing to the critical path between them. The stop request (and a
time-based save, train.save_every_minutes) is agreed by all ranks through an asynchronous
all-reduce on a CPU (gloo) group, issued one step and read the next, so every rank stops and
saves at the same step without a GPU sync. The run health guard (dstrain/rank/health.py) judges
the steps at every step that logs, evaluates or saves, before it does, and may roll back.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from dstrain.rank import checkpointing, heartbeat
from dstrain.rank.cadence import EarlyStop, SaveClock
from dstrain.rank.health import Guard, HealthState, RunUnhealthy
from dstrain.rank.evaluation import coverage, describe, evaluate
from dstrain.config.schema import RunConfig
from dstrain.data.sampler import rank_batch, to_device
from dstrain.rank.metrics import MetricsLog, engine_stats


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


def train(engine, config: RunConfig, run_dir: Path, train_sampler, eval_sampler, start_step: int,
          metrics: MetricsLog, device, client_state: Callable[[int], dict], stop: StopRequest,
          restored: dict | None = None) -> LoopState:
    """Train from start_step to train.max_steps; `restored`: the client state of the checkpoint resumed from."""
    t = config.train
    rank, world = dist.get_rank(), dist.get_world_size()
    vote = StopVote(dist.new_group(backend="gloo"))
    state = LoopState(step=start_step)
    health = HealthState.on_resume(restored.get("health"), run_dir) if restored else HealthState()
    guard = Guard(config, run_dir, rank, world, device, health, metrics)
    clock, early = SaveClock(t.save_every_minutes), EarlyStop(t.early_stop_patience, t.early_stop_min_delta)
    early.restore((restored or {}).get("early_stop"))

    def full_client_state(step: int) -> dict:
        return {**client_state(step), "health": health.client_state(), "early_stop": early.client_state()}

    # Training mode from the first step: a model loaded by from_pretrained comes in eval mode (no
    # dropout), one built under zero.Init in training mode; evaluation switches back and forth.
    engine.train()
    loss_sum = torch.zeros((), device=device)
    interval_start, interval_steps = time.perf_counter(), 0
    data_s = 0.0  # host time building batches in this log interval (no device wait: no sync)
    real_tokens: int | None = 0  # non-pad tokens trained on in this log interval (rank 0; None: unknown)
    metrics.start(start_step)

    while state.step < t.max_steps:
        lr = engine.optimizer.param_groups[0]["lr"]  # get_lr() warns before the first step
        data_step = guard.data_step(state.step)
        step_loss, fetch_s = _optimizer_step(engine, t, train_sampler, data_step, state.step, rank, world, device)
        if rank == 0:  # a pure function of the sample indices: no collective needed
            real_tokens = _add(real_tokens, train_sampler.real_tokens(data_step * t.global_batch_size,
                                                                      t.global_batch_size))
        data_s += fetch_s
        loss_sum += step_loss
        state.step += 1
        interval_steps += 1
        guard.record(state.step, step_loss, engine.get_global_grad_norm())
        if vote.result():
            state.stopped_by = stop.signal_name or "a signal on another rank"
        time_save = vote.save_due  # agreed by all ranks; this step's save resets every clock
        vote.cast(stop.signal_name is not None, clock.due() and not time_save)
        last = state.step == t.max_steps or state.stopped_by is not None
        logs = state.step % t.log_every == 0 or last
        evals = state.step % t.eval_every == 0 or (last and state.stopped_by is None)
        saves = t.save_checkpoints and (state.step % t.save_every == 0 or last or time_save)

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
            loss_sum.zero_()
            interval_start, interval_steps, data_s, real_tokens = time.perf_counter(), 0, 0.0, 0
            if state.stopped_by is not None:  # the checkpoint rolled back to is the one to resume from
                break
            continue
        if logs:
            dist.all_reduce(loss_sum)  # mean over ranks: every rank logs the same number
            loss_value = loss_sum.item() / (world * t.grad_accum_steps * interval_steps)
            elapsed = time.perf_counter() - interval_start
            metrics.log_step(state.step, loss_value, lr, elapsed, interval_steps, data_s, engine_stats(engine),
                             real_tokens)
            loss_sum.zero_()
            interval_start, interval_steps, data_s, real_tokens = time.perf_counter(), 0, 0.0, 0
        if evals:
            result = evaluate(engine, config, eval_sampler, device)
            eval_loss = result.loss
            metrics.log_eval(state.step, eval_loss, coverage(result), describe(result))
            state.early_stopped = early.update(state.step, eval_loss) and not last
            if state.early_stopped:
                _report_early_stop(metrics, early, state.step)
            interval_start = time.perf_counter()  # evaluation time is not training throughput
        if saves or (t.save_checkpoints and state.early_stopped):
            heartbeat.beat("save")
            saved = checkpointing.save(engine, run_dir, state.step, full_client_state(state.step), t.keep_last,
                                        t.checkpoint_hashes)
            clock.saved()
            metrics.note(f"checkpoint {saved.name} saved")
            interval_start = time.perf_counter()
        if state.stopped_by is not None or state.early_stopped:
            break
    vote.result()  # leave no collective in flight
    metrics.finish(state, saved_checkpoint=t.save_checkpoints)
    return state


def _add(total: int | None, count: int | None) -> int | None:
    return None if total is None or count is None else total + count


def _optimizer_step(engine, t, train_sampler, data_step: int, step: int, rank: int, world: int, device):
    """One optimizer step over train.grad_accum_steps micro-batches: (the summed loss, a device tensor
    nothing waits for; host seconds spent building batches)."""
    step_loss = torch.zeros((), device=device)
    fetch_s = 0.0
    for micro_step in range(t.grad_accum_steps):
        heartbeat.beat("data", step + 1)
        fetch_start = time.perf_counter()
        batch = to_device(rank_batch(train_sampler, data_step, micro_step, rank, world, t.micro_batch_size,
                                     t.grad_accum_steps), device)
        fetch_s += time.perf_counter() - fetch_start
        heartbeat.beat("forward")
        loss = engine(batch)
        heartbeat.beat("backward")
        engine.backward(loss)
        heartbeat.beat("step")
        engine.step()
        step_loss += loss.detach().float()
    return step_loss, fetch_s


def _report_early_stop(metrics: MetricsLog, early: EarlyStop, step: int) -> None:
    metrics.log_event("early_stop", step, best_eval_loss=early.best, best_step=early.best_step,
                      evals_without_improvement=early.since_best)
    metrics.note(f"early stop at step {step}: the eval loss has not improved for "
                 f"{early.since_best} evaluation(s) (best {early.best:.4f} at step {early.best_step})")
