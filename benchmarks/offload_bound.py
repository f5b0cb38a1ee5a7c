"""The speed limit of the CPU-offload presets on this machine, and a row's fraction of it.

Two host rates are measured (`measure`, run as its own process so the suite's driver never holds a CUDA
context): the host's Adam bandwidth, dstrain's CPU Adam op (speedups/cpu_adam_nogil.cpp, the offload
presets' step) updating an fp32 partition from bf16 gradients in 8M-element chunks, counted as the
26 bytes an element it reads and writes (weight, both moments read and written, the gradient read);
and the pinned host<->GPU copy rate in each direction (one 256 MiB copy, best of several).

The model of the bound (`bound`), per optimizer step of P trained parameters and A micro steps, with
dstrain's defaults (gradient sums kept on the GPU through a window, ZeRO-3's weights kept through it, the
ZeRO-3 step beside the next forward):
  Adam    P x 26 bytes / Adam bandwidth (stage3_offload rounds the new weights to bf16 in the same pass: 28)
  down    gradients to the host: 2 bytes a parameter in bf16 at A = 1; the fp32 sums once, 4 a parameter,
          when accumulating
  up      stage2_offload: each updated fp32 chunk to the GPU, rounded there (4 bytes a parameter);
          stage3_offload: the bf16 weights live on the host, fetched in the forward and again in the
          backward at A = 1 (2 x 2 bytes a parameter), once a window when accumulating (2 bytes)
  PCIe    max(down / device-to-host rate, up / host-to-device rate): the two directions run at once
  GPU     the step time of plain PyTorch at the same accumulation in the same call, else A x its step
          a batch (which counts torch's optimizer step A times); 0 where no torch row ran
stage2_offload's step starts after the last gradient and the next forward waits for its weights:
  bound = max(GPU, down) + max(Adam, up)
stage3_offload's step runs beside the next forward (speedups.offload_overlap), but it starts only after
the last backward (the clipping norm needs every gradient) and each layer of the next forward waits for
its weights' update, so the most it can hide is that first forward, a third of torch's micro step
(the backward does twice the forward's arithmetic):
  bound = max(GPU + max(0, Adam - GPU / A / 3), PCIe)
A row's fraction of the bound = bound / the row's measured step time (1.0: at the limit). It is a lower
bound on the time, not a prediction: it leaves out the host's Python, the norm, the GPU waiting for the
first chunk, and contention between the Adam pass and the copies for host memory.

    python3 benchmarks/offload_bound.py --elements 268435456       # prints the rates as JSON
"""

from __future__ import annotations

import argparse
import json
import os
import time

CHUNK = 1 << 23
ADAM_BYTES = 26          # per element: fp32 weight, exp_avg, exp_avg_sq read and written, bf16 grad read
ADAM_BYTES_ROUNDED = 28  # + the bf16 weight written in the same pass (stage3_offload's host rounding)


def _best_s(fn, repeats: int, sync=lambda: None) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times)


def host_adam_gb_s(elements: int, repeats: int = 3) -> tuple[float | None, str]:
    """(GB/s of the Adam update, which op ran): dstrain's GIL-free op, else DeepSpeed's CPUAdam step."""
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from dstrain.op_cache import remember_cpu_info, use_private_op_cache
    from dstrain.speedups.cpu_adam_nogil import adam_without_gil
    remember_cpu_info(use_private_op_cache(os.environ, "cpu"))  # the op cache dstrain's CPU ranks use
    master = torch.nn.Parameter(torch.randn(elements) * 0.02)
    adam = DeepSpeedCPUAdam([master], lr=1e-4, weight_decay=0.1)
    op = adam_without_gil(adam)
    if op is None:  # DeepSpeed's binding: fp32 gradients, the same passes over the states
        master.grad = torch.randn(elements) * 1e-3
        return elements * 28 / _best_s(adam.step, repeats) / 1e9, "DeepSpeedCPUAdam (fp32 grads)"
    state = adam.state[master]
    state["exp_avg"], state["exp_avg_sq"] = torch.zeros(elements), torch.zeros(elements)
    grads = (torch.randn(elements) * 1e-3).to(torch.bfloat16)
    step = [0]

    def update():
        step[0] += 1
        for start in range(0, elements, CHUNK):
            end = min(start + CHUNK, elements)
            op.adam_update_tiles(adam.opt_id, step[0], 1e-4, 0.9, 0.95, 1e-8, 0.1, True, master.data[start:end],
                                 grads[start:end], state["exp_avg"][start:end], state["exp_avg_sq"][start:end],
                                 1.0, 1 << 15, None)
    return elements * ADAM_BYTES / _best_s(update, repeats) / 1e9, "dstrain_cpu_adam_nogil"


def pcie_gb_s(nbytes: int = 1 << 28, repeats: int = 5) -> tuple[float | None, float | None]:
    """(host-to-device, device-to-host) GB/s of one pinned copy; (None, None) without CUDA."""
    import torch
    if not torch.cuda.is_available():
        return None, None
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    sync = torch.cuda.synchronize
    up = nbytes / _best_s(lambda: device.copy_(host, non_blocking=True), repeats, sync) / 1e9
    down = nbytes / _best_s(lambda: host.copy_(device, non_blocking=True), repeats, sync) / 1e9
    return up, down


def measure(elements: int, threads: int = 0) -> dict:
    import torch
    if threads:
        torch.set_num_threads(threads)
    adam, op = host_adam_gb_s(elements)
    up, down = pcie_gb_s()
    return {"adam_gb_s": adam, "adam_op": op, "adam_elements": elements, "threads": torch.get_num_threads(),
            "h2d_gb_s": up, "d2h_gb_s": down}


def bound(preset: str, params: int, accumulation: int, rates: dict, torch_step_s: float | None,
          torch_accumulation: int = 1) -> dict:
    """The step-time bound of an offload row in seconds, with its parts (see the module docstring);
    torch_step_s: torch's step over torch_accumulation micro steps (1 or the row's accumulation)."""
    a = accumulation
    zero3 = preset.startswith("stage3")
    adam = params * (ADAM_BYTES_ROUNDED if zero3 else ADAM_BYTES) / (rates["adam_gb_s"] * 1e9)
    down_bytes = params * (2 if a == 1 else 4)
    up_bytes = params * ((4 if a == 1 else 2) if zero3 else 4)
    down = down_bytes / (rates["d2h_gb_s"] * 1e9) if rates.get("d2h_gb_s") else 0.0
    up = up_bytes / (rates["h2d_gb_s"] * 1e9) if rates.get("h2d_gb_s") else 0.0
    gpu = a * torch_step_s / torch_accumulation if torch_step_s else 0.0
    if zero3:
        hidden = gpu / a / 3  # the next window's first forward, beside the step
        total = max(gpu + max(0.0, adam - hidden), down, up)
    else:
        total = max(gpu, down) + max(adam, up)
    return {"bound_s": total, "adam_s": adam, "down_s": down, "up_s": up, "gpu_s": gpu}


def bound_line(row: dict, parts: dict) -> str:
    """One line for the suite's output under an offload row."""
    step_s = row["step_ms"] / 1000
    return (f"  offload bound: {parts['bound_s'] * 1000:.0f} ms a step (Adam {parts['adam_s'] * 1000:.0f}, "
            f"grads down {parts['down_s'] * 1000:.0f}, weights up {parts['up_s'] * 1000:.0f}, "
            f"GPU {parts['gpu_s'] * 1000:.0f} ms); this row {step_s * 1000:.0f} ms = "
            f"{parts['bound_s'] / step_s:.2f} of the bound")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--elements", type=int, default=1 << 28, help="Adam partition to time (default 268M)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    args = p.parse_args()
    print(json.dumps(measure(args.elements, args.threads)))


if __name__ == "__main__":
    main()
