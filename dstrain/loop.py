"""The train loop: engine(batch) -> engine.backward(loss) -> engine.step(), with evaluation,
logging and checkpoints at their intervals, and a clean stop on SIGTERM/SIGINT.

Everything that needs the host to wait for the device (loss values, timing) happens only at
log steps, so the loop adds nothing to the critical path between them. The stop request is
agreed by all ranks through an asynchronous all-reduce on a CPU (gloo) group, issued one step
and read the next, so every rank stops and saves at the same step without a GPU sync.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from dstrain import checkpoint
from dstrain.config.schema import RunConfig
from dstrain.data.sampler import rank_batch
from dstrain.metrics import MetricsLog


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
    """All ranks learn at the same step whether any rank was asked to stop."""

    group: Any
    pending: Any = None
    flag: torch.Tensor = field(default_factory=lambda: torch.zeros(1))

    def cast(self, requested: bool) -> None:
        self.flag = torch.tensor([1.0 if requested else 0.0])
        self.pending = dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)

    def result(self) -> bool:
        if self.pending is None:
            return False
        self.pending.wait()
        self.pending = None
        return bool(self.flag.item() > 0)


@dataclass
class LoopState:
    step: int
    stopped_by: str | None = None


def _to_device(batch, device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch


def evaluate(engine, config: RunConfig, eval_sampler, device) -> float:
    """Mean held-out loss over the first eval_batches x global_batch_size held-out samples.

    The sample set depends on the global batch, not on the world size, so a run resumed with
    another number of ranks (same global batch) evaluates the same samples; each rank takes a
    contiguous share in micro batches."""
    rank, world = dist.get_rank(), dist.get_world_size()
    micro = config.train.micro_batch_size
    per_rank = config.train.eval_batches * config.train.global_batch_size // world
    batches = per_rank // micro
    engine.eval()
    total = torch.zeros((), device=device)
    with torch.no_grad():
        for i in range(batches):
            batch = eval_sampler.batch(rank * per_rank + i * micro, micro)
            total += engine(_to_device(batch, device)).float()
    engine.train()
    dist.all_reduce(total)
    return total.item() / (batches * world)


def train(engine, config: RunConfig, run_dir: Path, train_sampler, eval_sampler, start_step: int,
          metrics: MetricsLog, device, client_state: Callable[[int], dict], stop: StopRequest) -> LoopState:
    t = config.train
    rank, world = dist.get_rank(), dist.get_world_size()
    vote = StopVote(dist.new_group(backend="gloo"))
    state = LoopState(step=start_step)
    loss_sum = torch.zeros((), device=device)
    interval_start, interval_steps = time.perf_counter(), 0
    metrics.start(start_step)

    while state.step < t.max_steps:
        lr = engine.optimizer.param_groups[0]["lr"]  # get_lr() warns before the first step
        for micro_step in range(t.grad_accum_steps):
            batch = rank_batch(train_sampler, state.step, micro_step, rank, world, t.micro_batch_size,
                               t.grad_accum_steps)
            loss = engine(_to_device(batch, device))
            engine.backward(loss)
            engine.step()
            loss_sum += loss.detach().float()
        state.step += 1
        interval_steps += 1
        if vote.result():
            state.stopped_by = stop.signal_name or "a signal on another rank"
        vote.cast(stop.signal_name is not None)
        last = state.step == t.max_steps or state.stopped_by is not None

        if state.step % t.log_every == 0 or last:
            dist.all_reduce(loss_sum)  # mean over ranks: every rank logs the same number
            loss_value = loss_sum.item() / (world * t.grad_accum_steps * interval_steps)
            elapsed = time.perf_counter() - interval_start
            metrics.log_step(state.step, loss_value, lr, elapsed, interval_steps)
            loss_sum.zero_()
            interval_start, interval_steps = time.perf_counter(), 0
        if state.step % t.eval_every == 0 or (last and state.stopped_by is None):
            metrics.log_eval(state.step, evaluate(engine, config, eval_sampler, device))
            interval_start = time.perf_counter()  # evaluation time is not training throughput
        if t.save_checkpoints and (state.step % t.save_every == 0 or last):
            saved = checkpoint.save(engine, run_dir, state.step, client_state(state.step), t.keep_last)
            metrics.note(f"checkpoint {saved.name} saved")
            interval_start = time.perf_counter()
        if state.stopped_by is not None:
            break
    vote.result()  # leave no collective in flight
    metrics.finish(state, saved_checkpoint=t.save_checkpoints)
    return state
