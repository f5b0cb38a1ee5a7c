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


def cuda_gpu_memory_bytes() -> int | None:
    """The smallest visible NVIDIA GPU's memory on this host in bytes, from nvidia-smi (no CUDA context in
    this process, which would hold GPU memory while the ranks run). None where no GPU or nvidia-smi answers,
    or a GPU is split into MIG slices (nvidia-smi gives the whole card's memory, not a slice's)."""
    import shutil
    import subprocess
    if not cuda_gpu_count() or not shutil.which("nvidia-smi"):
        return None
    query = ["nvidia-smi", "--query-gpu=memory.total,mig.mode.current", "--format=csv,noheader,nounits"]
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if visible and all(v.isdigit() for v in visible):  # indices; UUIDs and MIG names: every GPU (the smallest)
        query.append(f"--id={','.join(visible)}")
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return smallest_gpu_memory(out)


def smallest_gpu_memory(nvidia_smi_csv: str) -> int | None:
    """Bytes of the smallest GPU in `nvidia-smi --query-gpu=memory.total,mig.mode.current` output (MiB,
    one line a GPU); None where a line is unreadable or MIG is on."""
    mib = []
    for line in nvidia_smi_csv.splitlines():
        if not line.strip():
            continue
        total, _, mig = (part.strip() for part in line.partition(","))
        if not total.isdigit() or mig.lower() == "enabled":
            return None
        mib.append(int(total))
    return min(mib) * 2**20 if mib else None


def host_memory_bytes() -> tuple[int, int]:
    """(total, available) host RAM in bytes, from /proc/meminfo."""
    fields = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        fields[key] = int(rest.split()[0]) * 1024
    return fields.get("MemTotal", 0), fields.get("MemAvailable", fields.get("MemFree", 0))


# Dense (no sparsity) bf16 tensor-core peaks in TFLOP/s from the vendors' data sheets, matched
# against the device name as CUDA reports it; the first match wins, so specific names come first.
# MFU = achieved model FLOP/s over this peak (PaLM, appendix B).
DENSE_BF16_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2500.0), ("B200", 2250.0), ("B100", 1750.0),
    ("GH200", 989.0), ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H800", 989.0),
    ("H200", 989.0), ("H20", 148.0),
    ("A100", 312.0), ("A800", 312.0), ("A10G", 70.0), ("A10", 125.0), ("A30", 165.0),
    ("L40S", 362.0), ("L40", 181.0), ("L4", 121.0),
    ("RTX 4090", 165.0), ("RTX 3090", 71.0),
)


def dense_bf16_peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU named like torch.cuda.get_device_name() or nvidia-smi
    ("NVIDIA H100 80GB HBM3" -> 989.0), or None for a device not in the table (CPUs included)."""
    name = device_name.upper()
    for key, peak in DENSE_BF16_PEAK_TFLOPS:
        if key.upper() in name:
            return peak
    return None
