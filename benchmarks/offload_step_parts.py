"""Where the host time of one ZeRO-1/2 CPU-offload optimizer step goes, without a model: DeepSpeed's
three passes over an N-element fp32 partition (unscale multiply, CPU Adam, fp32 -> bf16 copy into a
pinned buffer) and the copy to the GPU, timed one by one, against the same work done in chunks, with
the bf16 rounding on the host or (as dstrain/speedups/offload_chunked_step.py does) on the GPU. Prints a table; needs DeepSpeed's cpu_adam op (and CUDA for the copy).

    python3 benchmarks/offload_step_parts.py --elements 405899264
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--elements", type=int, default=405_899_264, help="partition size (default: the 406M GPT)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--chunks", default="524288,2097152,8388608")
    args = p.parse_args()
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    n = args.elements
    cuda = torch.cuda.is_available()
    pin = torch.cuda.is_available()
    master = torch.nn.Parameter(torch.randn(n).pin_memory() if pin else torch.randn(n))
    master.grad = torch.randn(n).pin_memory() if pin else torch.randn(n)
    adam = DeepSpeedCPUAdam([master], lr=1e-4, weight_decay=0.1)
    adam.step()  # the moments exist from here
    host_bf16 = torch.empty(n, dtype=torch.bfloat16).pin_memory() if pin else torch.empty(n, dtype=torch.bfloat16)
    device_bf16 = torch.empty(n, dtype=torch.bfloat16, device="cuda") if cuda else None
    state, group = adam.state[master], adam.param_groups[0]

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def timed(fn) -> float:
        fn()
        sync()
        best = float("inf")
        for _ in range(args.repeats):
            start = time.perf_counter()
            fn()
            sync()
            best = min(best, time.perf_counter() - start)
        return best * 1000

    staging = torch.empty(max(int(c) for c in args.chunks.split(",")), device="cuda") if cuda else None

    def chunked(chunk: int, round_on_gpu: bool = False):
        def run():
            state["step"] += 1
            b1, b2 = group["betas"]
            for s in range(0, n, chunk):
                e = min(s + chunk, n)
                g = master.grad[s:e]
                g.mul_(0.999)
                adam.ds_opt_adam.adam_update(adam.opt_id, state["step"], group["lr"], b1, b2, group["eps"],
                                             group["weight_decay"], group["bias_correction"], master.data[s:e], g,
                                             state["exp_avg"][s:e], state["exp_avg_sq"][s:e])
                if round_on_gpu:  # fp32 chunk to the GPU, rounded to bf16 there
                    staging[:e - s].copy_(master.data[s:e], non_blocking=True)
                    device_bf16[s:e].copy_(staging[:e - s])
                    continue
                host_bf16[s:e].copy_(master.data[s:e])
                if cuda:
                    device_bf16[s:e].copy_(host_bf16[s:e], non_blocking=True)
        return run

    rows = [("unscale multiply (whole)", timed(lambda: master.grad.mul_(0.999))),
            ("CPU Adam (whole)", timed(adam.step)),
            ("fp32 -> bf16 into pinned (whole)", timed(lambda: host_bf16.copy_(master.data))),
            ("bf16 pinned -> GPU (whole)", timed(lambda: device_bf16.copy_(host_bf16, non_blocking=True)) if cuda else 0.0)]
    rows.append(("sum of the four (DeepSpeed's order)", sum(ms for _, ms in rows)))
    for chunk in (int(c) for c in args.chunks.split(",")):
        rows.append((f"all four in chunks of {chunk:,}", timed(chunked(chunk))))
        if cuda:
            rows.append((f"  ... rounding on the GPU", timed(chunked(chunk, round_on_gpu=True))))
    print(f"{n:,} elements; torch threads {torch.get_num_threads()}; CUDA {cuda}")
    for name, ms in rows:
        print(f"{name:40} {ms:8.1f} ms")


if __name__ == "__main__":
    main()
