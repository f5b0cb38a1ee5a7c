"""tests/test_offload_step_zero3.py's GIL check: how long this thread pauses while another runs three
updates of DeepSpeed's CPU Adam op, and of dstrain's build of the same kernel (dstrain/speedups/cpu_adam_nogil.py), with how
long an update took in that same window (the pause a held GIL causes; it depends on the host and its load).

Each is measured three times and the calmest of the three kept: a held GIL pauses this thread in every try,
while a busy machine that takes the core away from it (another process's burst) does so only now and then."""

from __future__ import annotations

import sys
import threading
import time

import torch
from deepspeed.ops.op_builder import CPUAdamBuilder

from dstrain.speedups.cpu_adam_nogil import load_adam_without_gil
from scripts.rank_setup import parameters, result, start_rank

N = 1 << 25


def longest_pause(op, opt_id: int, tensors, tries: int = 3) -> tuple[float, float]:
    """(the longest pause of this thread while another thread runs three updates, the mean update of that
    window), for the try with the shortest pause."""
    op.create_adam(opt_id, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, False)
    op.adam_update(opt_id, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, *tensors)  # warm: threads, caches
    measured = []
    for attempt in range(tries):
        steps = [2 + 3 * attempt + i for i in range(3)]
        worker = threading.Thread(target=lambda: [op.adam_update(opt_id, s, 1e-3, 0.9, 0.999, 1e-8, 0.0, True,
                                                                 *tensors) for s in steps])
        started = last = time.perf_counter()
        longest = 0.0
        worker.start()
        while worker.is_alive():
            now = time.perf_counter()
            longest, last = max(longest, now - last), now
        measured.append((longest, (time.perf_counter() - started) / len(steps)))
    return min(measured)


def main(params: dict) -> None:
    start_rank(params)
    sys.setswitchinterval(0.001)  # a thread that waits for the GIL gets it back within about 1 ms
    tensors = [torch.randn(N), torch.randn(N), torch.zeros(N), torch.zeros(N)]
    result({"deepspeed": longest_pause(CPUAdamBuilder().load(), 90, tensors),
            "dstrain": longest_pause(load_adam_without_gil(), 91, tensors)})


if __name__ == "__main__":
    main(parameters())
