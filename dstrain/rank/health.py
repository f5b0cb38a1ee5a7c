"""Run health inside the ranks: spot a bad step, roll back to the last complete checkpoint before it,
skip that step's samples and train on; after train.max_rollbacks, give up with a report (exit 1).

A step is bad when its loss or DeepSpeed's global gradient norm is not finite (DeepSpeed reports an
inf/NaN bf16 norm as -1 when its per-gradient overflow check is off, as dstrain sets it for speed),
or, with train.spike_factor, when its loss exceeds that factor times the median of recent healthy
steps. Under fp16 (or bf16 with check_grad_overflow on) DeepSpeed itself skips steps whose gradients
overflow, so only the loss is judged there.

Cost: the loop hands each step's loss and gradient norm over as device tensors; they are read only
at steps that log, evaluate or save, which wait for the device anyway (one small all-reduce there).
Judging before every save means no checkpoint ever holds the weights of a bad step, so the newest
complete checkpoint before the bad step is a safe place to go back to.

With no complete checkpoint before the bad step (none saved yet, or train.save_checkpoints false) the
guard gives up rather than restart from the initial weights: that early, a non-finite loss points at
the settings (learning rate, data), not at one batch, and keeping a copy of the initial weights and
optimizer state would cost a model's worth of memory for the whole run.

Skipping is exact because the data position is a pure function of the step (dstrain/data/sampler.py):
optimizer step s (0-based) trains on data step `data_step(s, skipped)`, the s-th data step not in the
skip list, i.e. global samples [d*G, (d+1)*G) for global batch G. Only the first bad step's data is
skipped (the later ones were bad because of its update). The skip list and the rollback count travel
in every checkpoint's client state and in RUN_DIR/health.json (rewritten at each rollback, so resuming
from a checkpoint saved before a rollback still skips its data); a resume takes the union of both.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from dstrain.checkpoints import CompleteCheckpoint, complete_checkpoints
from dstrain.console_text import outside
from dstrain.rank.checkpointing import load
from dstrain.rundir import CHECKPOINTS, GAVE_UP, HEALTH, write_atomic


class RunUnhealthy(Exception):
    """The guard gave up: the message is the full report, `summary` one line for the rank's exit record."""

    def __init__(self, report: str, summary: str):
        super().__init__(report)
        self.summary = summary


# ---------------------------------------------------------------- skip-list arithmetic (pure)

def data_step(step_index: int, skipped: Sequence[int]) -> int:
    """The data step that optimizer step `step_index` (0-based) trains on: the step_index-th
    (0-based) natural number not in `skipped`."""
    position = step_index
    for bad in sorted(skipped):
        if bad > position:
            break
        position += 1
    return position


def samples_of(data_step_index: int, global_batch: int) -> range:
    """The global sample indices of one data step (what dstrain.data.sampler.rank_batch hands out)."""
    return range(data_step_index * global_batch, (data_step_index + 1) * global_batch)


def describe(samples: range) -> str:
    return f"{samples.start}-{samples.stop - 1}"


# ---------------------------------------------------------------- the detector (pure)

@dataclass
class Verdict:
    step: int  # the bad step, numbered as logged (1 = after the first optimizer step)
    reason: str


class Detector:
    """Judges per-step global losses and gradient norms, in step order."""

    def __init__(self, spike_factor: float | None, window: int):
        self.spike_factor = spike_factor
        self.recent: deque[float] = deque(maxlen=window)

    def judge(self, first_step: int, losses: Sequence[float], norms: Sequence[float | None]) -> Verdict | None:
        """The first bad step among `losses[i]`, `norms[i]` of steps first_step + i, or None.
        Healthy steps before it join the spike window."""
        for i, (loss, norm) in enumerate(zip(losses, norms)):
            step = first_step + i
            if not math.isfinite(loss):
                return Verdict(step, f"non-finite loss ({loss})")
            if norm is not None and (not math.isfinite(norm) or norm < 0):
                shown = f" ({norm})" if not math.isfinite(norm) else ""  # DeepSpeed's -1 stands for inf/NaN
                return Verdict(step, f"non-finite gradient norm{shown}")
            if self.spike_factor is not None and len(self.recent) == self.recent.maxlen:
                median = statistics.median(self.recent)
                if loss > self.spike_factor * median:
                    return Verdict(step, f"loss spike ({loss:.4g} > {self.spike_factor:g} x the median "
                                         f"{median:.4g} of the last {len(self.recent)} steps)")
            self.recent.append(loss)
        return None


# ---------------------------------------------------------------- persisted state

@dataclass
class HealthState:
    skipped: list[int] = field(default_factory=list)     # data steps left out, sorted
    rollbacks: list[dict] = field(default_factory=list)  # one record per rollback, oldest first

    def client_state(self) -> dict[str, Any]:
        return {"skipped_data_steps": list(self.skipped), "rollbacks": list(self.rollbacks)}

    @classmethod
    def on_resume(cls, client: dict | None, run_dir: Path) -> "HealthState":
        """The union of what the checkpoint carries and what RUN_DIR/health.json recorded since."""
        saved = client or {}
        try:
            recorded = json.loads((run_dir / HEALTH).read_text())
        except (OSError, ValueError):
            recorded = {}
        rollbacks = max(saved.get("rollbacks", []), recorded.get("rollbacks", []), key=len)
        skipped = set(saved.get("skipped_data_steps", [])) | set(recorded.get("skipped_data_steps", []))
        return cls(sorted(skipped), list(rollbacks))

    def write(self, run_dir: Path) -> None:
        write_atomic(run_dir / HEALTH, json.dumps(self.client_state(), indent=1))


def rollback_target(directory: Path, bad_step: int, world: int) -> CompleteCheckpoint | None:
    """The complete checkpoint saved last among those before `bad_step` (by this world size)."""
    before = [c for c in complete_checkpoints(directory) if c.step < bad_step and c.world_size == world]
    return before[-1] if before else None


def uses_own_norm_check(config) -> bool:
    """Whether DeepSpeed skips overflowing steps itself (fp16's loss scaler, bf16 with its check on)."""
    if config.train.precision == "fp16":
        return True
    bf16 = config.deepspeed.get("bf16") or {}
    return config.train.precision in ("bf16", "fp8") and bool(bf16.get("check_grad_overflow"))  # fp8: bf16 weights


# ---------------------------------------------------------------- the guard (all ranks)

class Guard:
    """Collects each step's loss and gradient norm without a sync; judges them at sync points; rolls
    back or gives up. Every rank runs the same judgement on the same all-reduced numbers."""

    def __init__(self, config, run_dir: Path, rank: int, world: int, device, state: HealthState, metrics):
        t = config.train
        self.run_dir, self.rank, self.world, self.device = run_dir, rank, world, device
        self.state, self.metrics = state, metrics
        self.detector = Detector(t.spike_factor, t.spike_window)
        self.max_rollbacks = t.max_rollbacks
        self.saves_checkpoints = t.save_checkpoints
        self.global_batch = t.global_batch_size
        self.per_step_terms = world * t.grad_accum_steps
        self.judge_norms = not uses_own_norm_check(config)
        self.losses: list = []
        self.norms: list = []
        self.first_step = 0

    def data_step(self, step_index: int) -> int:
        return data_step(step_index, self.state.skipped)

    def record(self, step: int, loss_sum, grad_norm) -> None:
        """Step `step`'s summed micro-batch loss on this rank (a device tensor) and DeepSpeed's norm."""
        if not self.losses:
            self.first_step = step
        self.losses.append(loss_sum)
        self.norms.append(grad_norm if self.judge_norms else None)

    def check(self) -> Verdict | None:
        """Judge the steps recorded since the last check (a collective: every rank calls it)."""
        import torch
        import torch.distributed as dist
        if not self.losses:
            return None
        has_norm = [n is not None for n in self.norms]
        norms = [torch.as_tensor(n if n is not None else 0.0, dtype=torch.float32).to(self.device).reshape(())
                 for n in self.norms]
        values = torch.cat([torch.stack(self.losses).float(), torch.stack(norms)])
        dist.all_reduce(values)  # sum: the losses over ranks; each norm is global already (world copies)
        values = values.tolist()
        count = len(self.losses)
        losses = [v / self.per_step_terms for v in values[:count]]
        norms_seen = [v / self.world if has else None for v, has in zip(values[count:], has_norm)]
        first, self.losses, self.norms = self.first_step, [], []
        return self.detector.judge(first, losses, norms_seen)

    def recover(self, engine, verdict: Verdict, at_step: int) -> int:
        """Roll back past the bad step and return the step to continue from, or raise RunUnhealthy."""
        bad_data = self.data_step(verdict.step - 1)
        samples = samples_of(bad_data, self.global_batch)
        if len(self.state.rollbacks) >= self.max_rollbacks:
            self._give_up(verdict, samples, at_step, f"train.max_rollbacks is {self.max_rollbacks} and "
                                                     f"{len(self.state.rollbacks)} rollback(s) were made")
        target = rollback_target(self.run_dir / CHECKPOINTS, verdict.step, self.world)
        if target is None:
            self._give_up(verdict, samples, at_step, "no complete checkpoint before that step to roll back to "
                          + ("(train.save_checkpoints is false)" if not self.saves_checkpoints else
                             "(a lower train.save_every saves the first one earlier)"))
        self.state.skipped = sorted(set(self.state.skipped) | {bad_data})
        record = {"from_step": at_step, "to_step": target.step, "bad_step": verdict.step, "reason": verdict.reason,
                  "skipped_samples": [samples.start, samples.stop], "skipped_data_step": bad_data,
                  "checkpoint": target.tag}
        self.state.rollbacks.append(record)
        if self.rank == 0:
            self.state.write(self.run_dir)  # before loading: a crash while loading still skips this data
        if engine.load_universal_checkpoint():
            # The run started from a universal checkpoint (another world size); the ones it saved are not.
            from dstrain.speedups.engine_flags import stop_loading_universal_checkpoints
            stop_loading_universal_checkpoints(engine)
        load(engine, target.directory, target.tag, self.rank, self.world)
        self.losses, self.norms = [], []
        self.metrics.log_event("rollback", at_step, **record)
        self.metrics.note(f"run health: {verdict.reason} at step {verdict.step}; rolled back from step {at_step} "
                          f"to {target.tag}, skipping global samples {describe(samples)} "
                          f"(rollback {len(self.state.rollbacks)} of at most {self.max_rollbacks})")
        return target.step

    def _give_up(self, verdict: Verdict, samples: range, at_step: int, why: str) -> None:
        lines = [f"run health: gave up at step {at_step}: {verdict.reason} at step {verdict.step} "
                 f"(global samples {describe(samples)}); {why}"]
        for i, r in enumerate(self.state.rollbacks, 1):
            lines.append(f"  rollback {i}: {r['reason']} at step {r['bad_step']}; back from step {r['from_step']} "
                         f"to step {r['to_step']}, skipped global samples "
                         f"{describe(range(*r['skipped_samples']))}")
        lines.append("  fix: check the data of those samples and the learning rate (train.lr, train.warmup_steps); "
                     "to train on, raise train.max_rollbacks and continue with --resume latest "
                     "(the skipped samples stay skipped)")
        self.metrics.log_event("gave_up", at_step, bad_step=verdict.step, reason=verdict.reason,
                               samples=[samples.start, samples.stop], rollbacks=len(self.state.rollbacks))
        if self.rank == 0:
            self.metrics.console.print(outside("\n".join(lines)), soft_wrap=True)
        raise RunUnhealthy("\n".join(lines), f"{GAVE_UP} at step {at_step}: {verdict.reason} at step "
                                             f"{verdict.step} (global samples {describe(samples)})")
