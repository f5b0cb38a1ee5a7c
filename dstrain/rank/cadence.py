"""When to save and stop besides the fixed step intervals: the time-based save clock
(train.save_every_minutes) and early stopping on eval loss (train.early_stop_patience).

Both only decide; the train loop acts. The clock's answer is local to a rank, so the loop agrees on it
through its asynchronous CPU vote (any rank due: all save at the same step). The early-stop decision
needs no vote: every rank sees the same all-reduced eval loss.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass


class SaveClock:
    """Due once `minutes` have passed since the start or the last save; never due without minutes."""

    def __init__(self, minutes: float | None, clock=time.monotonic):
        self.period = minutes * 60 if minutes else None
        self.clock = clock
        self.last = clock()

    def due(self) -> bool:
        return self.period is not None and self.clock() - self.last >= self.period

    def saved(self) -> None:
        self.last = self.clock()


@dataclass
class EarlyStop:
    """Counts evaluations without an improvement of more than min_delta on the best eval loss.
    The best and the count travel in checkpoints, so a resumed run keeps counting."""

    patience: int | None
    min_delta: float = 0.0
    best: float = math.inf
    best_step: int | None = None
    since_best: int = 0

    def update(self, step: int, eval_loss: float) -> bool:
        """Note one evaluation; True when the run should stop now."""
        if eval_loss < self.best - self.min_delta:
            self.best, self.best_step, self.since_best = eval_loss, step, 0
        else:
            self.since_best += 1
        return self.patience is not None and self.since_best >= self.patience

    def client_state(self) -> dict:
        return {"best": None if math.isinf(self.best) else self.best, "best_step": self.best_step,
                "since_best": self.since_best}

    def restore(self, saved: dict | None) -> None:
        if saved and saved.get("best") is not None:
            self.best, self.best_step, self.since_best = saved["best"], saved["best_step"], saved["since_best"]
