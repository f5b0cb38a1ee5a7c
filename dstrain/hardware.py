"""What this machine has, found without importing torch (the CLI must start at once)."""

from __future__ import annotations

import os
from pathlib import Path


def cuda_gpu_count() -> int:
    """NVIDIA GPUs visible to this process, from the driver's /proc entries and CUDA_VISIBLE_DEVICES."""
    gpus = Path("/proc/driver/nvidia/gpus")
    count = len(list(gpus.iterdir())) if gpus.is_dir() else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and count:
        count = min(count, len([v for v in visible.split(",") if v.strip() and v.strip() != "-1"]))
    return count


def resolve_accelerator(choice: str) -> str:
    """"auto" -> "cuda" when an NVIDIA GPU is visible, else "cpu"."""
    if choice == "auto":
        return "cuda" if cuda_gpu_count() > 0 else "cpu"
    return choice


def default_ranks_per_node(accelerator: str) -> int:
    """One rank per GPU; on CPU two ranks (enough to exercise ZeRO sharding) when there are two cores."""
    if accelerator == "cuda":
        return max(cuda_gpu_count(), 1)
    return 2 if (os.cpu_count() or 1) >= 2 else 1


def host_memory_bytes() -> tuple[int, int]:
    """(total, available) host RAM in bytes, from /proc/meminfo."""
    fields = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        fields[key] = int(rest.split()[0]) * 1024
    return fields.get("MemTotal", 0), fields.get("MemAvailable", fields.get("MemFree", 0))
