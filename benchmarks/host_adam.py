"""How fast this host runs the CPU-offload optimizer update, without a model: its memory bandwidth
(a stream copy and add over 1 GiB tensors) against dstrain's Adam update from bf16 gradients (the
offload presets' step, dstrain/speedups/cpu_adam_nogil.cpp) over an N-element partition in 8M-element
chunks, alone, with the new weights rounded to bf16 in the same pass (the ZeRO-3 offload step with
parameter offload), and with each chunk's fp32 weights sent to the GPU, rounded there and the bf16
values sent back into a pinned host partition (that step before host rounding). Prints a table.

    python3 benchmarks/host_adam.py --elements 405899264 --threads 15
"""

from __future__ import annotations

import argparse
import time

import torch

CHUNK = 1 << 23


def best_ms(fn, repeats: int) -> float:
    fn()  # first touch, caches
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1000)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--elements", type=int, default=405_899_264, help="partition size (default: the 406M GPT)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    p.add_argument("--repeats", type=int, default=4)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from dstrain.speedups.cpu_adam_nogil import adam_without_gil

    rows = []
    big = 1 << 28  # 1 GiB of fp32
    a, b, c = torch.rand(big), torch.rand(big), torch.empty(big)
    ms = best_ms(lambda: c.copy_(a), args.repeats)
    rows.append(("copy, 1 GiB fp32", ms, 8 * big / ms / 1e6))
    ms = best_ms(lambda: torch.add(a, b, out=c), args.repeats)
    rows.append(("add, 1 GiB fp32 x 3", ms, 12 * big / ms / 1e6))
    del a, b, c

    n = args.elements
    cuda = torch.cuda.is_available()
    pin = (lambda t: t.pin_memory()) if cuda else (lambda t: t)
    master = torch.nn.Parameter(pin(torch.randn(n) * 0.02))
    adam = DeepSpeedCPUAdam([master], lr=1e-4, weight_decay=0.1)
    op = adam_without_gil(adam)
    state = adam.state[master]
    state["exp_avg"], state["exp_avg_sq"] = torch.zeros(n), torch.zeros(n)
    grads = pin((torch.randn(n) * 1e-3).to(torch.bfloat16))
    host_bf16 = pin(torch.empty(n, dtype=torch.bfloat16))
    step = [0]

    def update(start, end, factor=0.5, rounded=None):
        op.adam_update_tiles(adam.opt_id, step[0], 1e-4, 0.9, 0.95, 1e-8, 0.1, True, master.data[start:end],
                             grads[start:end], state["exp_avg"][start:end], state["exp_avg_sq"][start:end],
                             factor, 1 << 15, rounded)

    def adam_alone():
        step[0] += 1
        for start in range(0, n, CHUNK):
            update(start, min(start + CHUNK, n))

    ms = best_ms(adam_alone, args.repeats)
    # bytes the update moves: weights and both moments read and written (24), the bf16 gradient read (2)
    rows.append((f"Adam from bf16 grads, {n / 1e6:.0f}M", ms, 26 * n / ms / 1e6))

    def adam_rounding_in_its_pass():  # what the ZeRO-3 step does with parameter offload (host rounding)
        step[0] += 1
        for start in range(0, n, CHUNK):
            end = min(start + CHUNK, n)
            update(start, end, rounded=host_bf16[start:end])

    ms = best_ms(adam_rounding_in_its_pass, args.repeats)
    rows.append(("  + bf16 rounding in the same pass, into host memory", ms, 28 * n / ms / 1e6))
    if cuda:
        staging32 = torch.empty(CHUNK, device="cuda")
        staging16 = torch.empty(CHUNK, dtype=torch.bfloat16, device="cuda")

        def adam_and_round_on_gpu():
            step[0] += 1
            for start in range(0, n, CHUNK):
                end = min(start + CHUNK, n)
                update(start, end)
                staging32[:end - start].copy_(master.data[start:end], non_blocking=True)
                staging16[:end - start].copy_(staging32[:end - start])
                host_bf16[start:end].copy_(staging16[:end - start], non_blocking=True)

        ms = best_ms(adam_and_round_on_gpu, args.repeats)
        rows.append(("  + fp32 to GPU, bf16 back (ZeRO-3 offload step)", ms, 32 * n / ms / 1e6))

        def adam_and_round_on_host():
            step[0] += 1
            for start in range(0, n, CHUNK):
                end = min(start + CHUNK, n)
                update(start, end)
                host_bf16[start:end].copy_(master.data[start:end])

        ms = best_ms(adam_and_round_on_host, args.repeats)
        rows.append(("  + bf16 rounding on the host, chunk by chunk", ms, 32 * n / ms / 1e6))

    print(f"threads {torch.get_num_threads()}, {n:,} elements, chunks of {CHUNK:,}")
    print(f"{'':<52} {'ms':>8} {'GB/s':>8}")
    for name, ms, rate in rows:
        print(f"{name:<52} {ms:8.1f} {rate:8.1f}")


if __name__ == "__main__":
    main()
