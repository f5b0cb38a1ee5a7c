"""`dstrain doctor`: can this machine train, and how to fix what cannot.

`collect()` gathers facts into one JSON-serialisable dict whose `problems` list gives each
problem with a concrete fix; `render()` shows the report as tables; `main()` is the CLI entry.
Nothing here builds a DeepSpeed op: op checks only ask DeepSpeed whether an op could be
built and look for prebuilt or JIT-cached binaries, so a doctor run takes a few seconds.
torch and deepspeed are imported inside `collect()` so importing this module stays cheap.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import io
import json
import mmap
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

import dstrain
from dstrain.console_text import outside
from dstrain.launcher.env_fixes import (ARCH_LIST_VAR, bytecode_cache_dir, sanitize_cuda_arch_list,
                                        stale_extension_locks, torch_package)
from dstrain.op_cache import built_ops, op_cache, op_cache_key

# The ops dstrain's features rely on, and what each is for.
KEY_OPS = {
    "cpu_adam": "ZeRO optimizer offload to CPU",
    "fused_adam": "fused Adam on the accelerator",
    "async_io": "ZeRO-Infinity offload to NVMe",
}

# NVMe probe: large enough to get past caches, bounded in time so a slow disk stays quick.
PROBE_BYTES = 64 * 2**20
PROBE_CHUNK = 8 * 2**20
PROBE_BUDGET_S = 0.8  # per direction

SHM_MIN_BYTES = 2**30
_NUMERIC_ARCH = re.compile(r"^\d+\.\d+(\+PTX)?$")

Report = dict[str, Any]
Problems = list[dict[str, str]]


def _problem(problems: Problems, check: str, severity: str, message: str, fix: str) -> None:
    assert severity in ("error", "warning"), severity
    problems.append({"check": check, "severity": severity, "message": message, "fix": fix})


# --------------------------------------------------------------------------- collect


def collect(nvme_path: Path | None = None) -> Report:
    """Check this machine and return the report (see the module docstring).

    `nvme_path` is where ZeRO-Infinity would offload; without it the system temp dir is
    probed, and NVMe-only problems (libaio, O_DIRECT) are warnings rather than errors.
    The sections that need torch or deepspeed ("cuda", "gpus", "accelerator", "ops",
    "build_tools") are left out when those fail to import; that failure is an error problem.
    """
    problems: Problems = []
    report: Report = {
        "versions": {
            "python": platform.python_version(),
            "torch": None,
            "deepspeed": None,
            "dstrain": dstrain.__version__,
        },
        "host": _host(problems),
        "bytecode": _bytecode(),
    }

    try:
        import torch
    except Exception as exc:  # a broken install is exactly what doctor is for
        _problem(problems, "torch", "error", f"torch failed to import: {exc}", "pip install torch")
        torch = None
    if torch is not None:
        report["versions"]["torch"] = torch.__version__
        report["cuda"], report["gpus"] = _cuda(torch, problems)

    ds = None
    if torch is not None:
        try:
            import deepspeed as ds
        except Exception as exc:
            _problem(problems, "deepspeed", "error", f"deepspeed failed to import: {exc}",
                     "pip install deepspeed==0.19.8")
    if ds is not None:
        report["versions"]["deepspeed"] = ds.__version__
        report["accelerator"] = _accelerator(report, problems)
        report["op_cache"] = _op_cache(report["accelerator"]["name"])
        report["ops"] = _ops(torch, report["accelerator"]["name"])
        report["build_tools"] = _build_tools(report["ops"], problems)

    report["libaio"] = _libaio(report.get("ops", {}), nvme_path is not None, problems)
    report["torch_cuda_arch_list"] = _arch_list(report.get("gpus", []), problems)
    report["extension_locks"] = _locks(problems, Path(report["op_cache"]["path"]) if "op_cache" in report else None)
    report["shm_buffers"] = _shm_buffers(problems)

    nvme, nvme_problems = check_nvme(nvme_path or Path(tempfile.gettempdir()),
                                     explicit=nvme_path is not None)
    report["nvme"] = nvme
    problems.extend(nvme_problems)

    report["problems"] = problems
    return report


def _host(problems: Problems) -> dict[str, Any]:
    mem = _meminfo()
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    shm_total = None
    if Path("/dev/shm").is_dir():
        shm_total = shutil.disk_usage("/dev/shm").total
        if shm_total < SHM_MIN_BYTES:
            _problem(
                problems, "shm", "warning",
                f"/dev/shm holds only {shm_total // 2**20} MiB: DataLoader workers and "
                "DeepSpeed's shared-memory communication run out of it",
                "in Docker, start the container with --shm-size=16g (or --ipc=host)",
            )
    return {
        "ram_total_bytes": mem.get("MemTotal"),
        "ram_available_bytes": mem.get("MemAvailable"),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "shm_total_bytes": shm_total,
    }


def _bytecode() -> dict[str, Any]:
    """Whether torch's bytecode is kept: without it every process that imports torch compiles it
    again (seconds), and `dstrain run` keeps it in its own cache (env_fixes.bytecode_cache_dir)."""
    folder = bytecode_cache_dir(torch_package(), os.environ, bool(sys.flags.dont_write_bytecode))
    return {"prefix": os.environ.get("PYTHONPYCACHEPREFIX"), "dstrain_cache": str(folder) if folder else None}


def _meminfo() -> dict[str, int]:
    """/proc/meminfo values in bytes (empty off Linux)."""
    values: dict[str, int] = {}
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return values
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            unit = 1024 if fields[1:] == ["kB"] else 1
            values[key] = int(fields[0]) * unit
    return values


def _nvidia_hardware_present() -> bool:
    gpus = Path("/proc/driver/nvidia/gpus")
    return (gpus.is_dir() and any(gpus.iterdir())) or any(Path("/dev").glob("nvidia[0-9]*"))


def _cuda(torch: Any, problems: Problems) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    built_with = torch.version.cuda
    available = bool(torch.cuda.is_available())
    cuda: dict[str, Any] = {
        "torch_built_with": built_with,
        "hip": torch.version.hip,
        "available": available,
        "device_count": torch.cuda.device_count() if available else 0,
        "cuda_home": None,
        "nvcc_version": None,
    }
    gpus = []
    for index in range(cuda["device_count"]):
        props = torch.cuda.get_device_properties(index)
        gpus.append({
            "index": index,
            "name": props.name,
            "total_memory_bytes": int(props.total_memory),
            "compute_capability": f"{props.major}.{props.minor}",
            # bf16 tensor cores arrived with Ampere (8.0); ROCm reports it through torch.
            "bf16": props.major >= 8 if torch.version.hip is None else bool(torch.cuda.is_bf16_supported()),
        })

    hardware = _nvidia_hardware_present()
    if built_with is None and torch.version.hip is None and hardware:
        _problem(
            problems, "cuda", "error",
            f"torch {torch.__version__} is a CPU-only build, but this machine has an NVIDIA GPU",
            "pip install --force-reinstall torch --index-url https://download.pytorch.org/whl/cu128",
        )
    elif built_with is not None and not available and hardware:
        if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
            fix = "unset CUDA_VISIBLE_DEVICES"
        else:
            fix = f"run nvidia-smi; the driver must support CUDA {built_with} (update the driver)"
        _problem(problems, "cuda", "error",
                 f"torch was built with CUDA {built_with} but cannot use the GPU", fix)

    if built_with is not None:
        from torch.utils.cpp_extension import CUDA_HOME

        cuda["cuda_home"] = CUDA_HOME
        nvcc = Path(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else None
        if nvcc is not None and nvcc.is_file():
            cuda["nvcc_version"] = _nvcc_version(nvcc)
        if available:
            toolkit_fix = (f"install the CUDA {built_with} toolkit and "
                           f"export CUDA_HOME=/usr/local/cuda-{built_with}")
            if cuda["nvcc_version"] is None:
                _problem(problems, "cuda", "warning",
                         "no nvcc found: DeepSpeed cannot JIT-build its CUDA ops (e.g. fused_adam)",
                         toolkit_fix)
            elif cuda["nvcc_version"].split(".")[0] != built_with.split(".")[0]:
                _problem(problems, "cuda", "warning",
                         f"nvcc is CUDA {cuda['nvcc_version']} but torch was built with CUDA "
                         f"{built_with}: DeepSpeed refuses to JIT-build ops across major versions",
                         toolkit_fix)
    return cuda, gpus


def _nvcc_version(nvcc: Path) -> str | None:
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True,
                             timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+\.\d+)", out)
    return match.group(1) if match else None


def _accelerator(report: Report, problems: Problems) -> dict[str, Any]:
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    name = accel.device_name()
    if report["cuda"]["available"] and name == "cpu":
        _problem(problems, "accelerator", "error",
                 "a GPU is available but DeepSpeed selected its CPU accelerator",
                 "unset DS_ACCELERATOR" if os.environ.get("DS_ACCELERATOR") else
                 "export DS_ACCELERATOR=cuda")
    return {
        "name": name,
        "communication_backend": accel.communication_backend_name(),
        "ds_accelerator_env": os.environ.get("DS_ACCELERATOR"),
    }


def _op_cache(accelerator: str) -> dict[str, Any]:
    """Where dstrain's ranks build DeepSpeed's JIT ops on this machine for `accelerator`, and what is built:
    the user's TORCH_EXTENSIONS_DIR, else dstrain's private folder for this Python environment and these
    torch and DeepSpeed versions (dstrain/launcher/env_fixes.py, op_cache)."""
    folder, private = op_cache(os.environ, accelerator)
    return {"path": str(folder), "private": private, "keyed_by": op_cache_key(accelerator) if private else None,
            "built": built_ops(folder)}


def _ops(torch: Any, accelerator: str) -> dict[str, dict[str, Any]]:
    from deepspeed import git_version_info
    from deepspeed.ops.op_builder.all_ops import ALL_OPS

    # Prebuilt ops only load when they were built for the accelerator in use now.
    prebuilt_for = getattr(git_version_info, "accelerator_name", "")
    build_dir, _ = op_cache(os.environ, accelerator)
    ops = {}
    for name, builder in sorted(ALL_OPS.items()):
        try:
            compatible, error = bool(builder.is_compatible(verbose=False)), None
        except Exception as exc:  # a builder's own probe can fail on odd systems
            compatible, error = False, str(exc)
        cached = build_dir / name / f"{name}.so"
        ops[name] = {
            "builder": type(builder).__name__,
            "compatible": compatible,
            "installed": bool(git_version_info.installed_ops.get(name)) and prebuilt_for == accelerator,
            "jit_cached": cached.is_file(),
            "cache_path": str(cached),
            "error": error,
        }
    return ops


def _build_tools(ops: dict[str, dict[str, Any]], problems: Problems) -> dict[str, Any]:
    ninja = shutil.which("ninja")
    cxx = shutil.which(os.environ.get("CXX", "c++"))
    # Ops the features need that would have to be JIT-built on first use.
    to_build = [name for name in KEY_OPS
                if name in ops and ops[name]["compatible"]
                and not ops[name]["installed"] and not ops[name]["jit_cached"]]
    if to_build and ninja is None:
        _problem(problems, "build_tools", "warning",
                 f"ninja not found: DeepSpeed cannot JIT-build {', '.join(to_build)}",
                 "pip install ninja")
    if to_build and cxx is None:
        _problem(problems, "build_tools", "warning",
                 f"no C++ compiler: DeepSpeed cannot JIT-build {', '.join(to_build)}",
                 _install_command("build-essential", "gcc-c++", "base-devel"))

    for name, why in KEY_OPS.items():
        op = ops.get(name)
        if op is None or op["compatible"] or op["installed"] or op["jit_cached"]:
            continue
        if name == "async_io":
            continue  # explained, with its fix, by the libaio check
        _problem(problems, f"ops.{name}", "warning",
                 f"DeepSpeed op {name} ({why}) cannot be built here"
                 + (f": {op['error']}" if op["error"] else ""),
                 f"python -c 'from deepspeed.ops.op_builder import {op['builder']}; "
                 f"{op['builder']}().is_compatible(verbose=True)' shows why")
    return {"ninja": ninja, "cxx": cxx, "jit_needed": to_build}


def _install_command(apt: str, rpm: str, pacman: str) -> str:
    if shutil.which("apt-get"):
        return f"apt-get install -y {apt}"
    if shutil.which("dnf"):
        return f"dnf install -y {rpm}"
    if shutil.which("yum"):
        return f"yum install -y {rpm}"
    if shutil.which("pacman"):
        return f"pacman -S {pacman}"
    return f"install {apt} (Debian/Ubuntu) or {rpm} (RHEL/Fedora) with your package manager"


def _flag_dirs(var: str, flag: str) -> list[Path]:
    """Directories passed as -I/-L in CFLAGS/LDFLAGS, which DeepSpeed's compile test honours."""
    return [Path(word[len(flag):]) for word in shlex.split(os.environ.get(var, ""))
            if word.startswith(flag) and len(word) > len(flag)]


def _libaio(ops: dict[str, dict[str, Any]], nvme_requested: bool, problems: Problems) -> dict[str, Any]:
    include_dirs = _flag_dirs("CFLAGS", "-I") + [Path("/usr/local/include"), Path("/usr/include")]
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    lib_dirs = _flag_dirs("LDFLAGS", "-L") + [
        Path("/usr/local/lib"), Path("/usr/lib", multiarch), Path("/usr/lib64"), Path("/usr/lib")]
    header = next((str(d / "libaio.h") for d in include_dirs if (d / "libaio.h").is_file()), None)
    # `-laio` links against the unversioned libaio.so that only the dev package ships.
    dev_library = next((str(d / "libaio.so") for d in lib_dirs if (d / "libaio.so").exists()), None)
    runtime = ctypes.util.find_library("aio")

    aio = ops.get("async_io", {})
    prebuilt = aio.get("installed") or aio.get("jit_cached")
    ok = bool(runtime) if prebuilt else bool(header and dev_library)
    if not ok:
        missing = [what for what, found in (("libaio.h", header), ("libaio.so", dev_library),
                                            ("the libaio runtime", runtime)) if not found]
        _problem(
            problems, "libaio", "error" if nvme_requested else "warning",
            f"libaio missing ({', '.join(missing)}): DeepSpeed's async_io op, needed for "
            "ZeRO-Infinity NVMe offload, cannot be built",
            _install_command("libaio-dev", "libaio-devel", "libaio"),
        )
    return {"ok": ok, "header": header, "dev_library": dev_library, "runtime_library": runtime}


def _arch_list(gpus: list[dict[str, Any]], problems: Problems) -> dict[str, Any]:
    raw = os.environ.get(ARCH_LIST_VAR)
    fixed_env, note = sanitize_cuda_arch_list(os.environ)
    value = fixed_env.get(ARCH_LIST_VAR)
    info = {"value": raw, "sanitized": value if note else None, "note": note}
    if not value or not value.strip():
        return info
    entries = [e for e in re.split(r"[;\s]+", value) if e]
    good = [e for e in entries if _NUMERIC_ARCH.match(e)]
    bad = [e for e in entries if e not in good]
    if note or bad:
        reasons = [note] if note else []
        if bad:
            reasons.append(f"entries {bad} are not numeric compute capabilities DeepSpeed can parse")
        if note and not bad:
            reasons.append("dstrain's launcher applies this fix to its ranks; other tools crash")
        _problem(problems, ARCH_LIST_VAR, "warning", "; ".join(reasons),
                 f"export {ARCH_LIST_VAR}={shlex.quote(';'.join(good))}" if good
                 else f"unset {ARCH_LIST_VAR}")

    # Kernels built only for other archs do not run on a GPU unless a lower +PTX entry covers it.
    def cc(entry: str) -> tuple[int, ...]:
        return tuple(int(part) for part in entry.split("+")[0].split("."))

    missing: list[str] = []
    for gpu in gpus:
        mine = cc(gpu["compute_capability"])
        covered = any(cc(e) == mine or (e.endswith("+PTX") and cc(e) <= mine) for e in good)
        if not covered and gpu["compute_capability"] not in missing:
            missing.append(gpu["compute_capability"])
    if missing:
        _problem(problems, ARCH_LIST_VAR, "warning",
                 f"{ARCH_LIST_VAR}={raw!r} leaves out this machine's GPUs ({', '.join(missing)}): "
                 "ops built with it will not run on them",
                 f"export {ARCH_LIST_VAR}={shlex.quote(';'.join(good + missing))}")
    return info


def _locks(problems: Problems, folder: Path | None) -> dict[str, Any]:
    stale = stale_extension_locks(folder)
    for lock in stale:
        _problem(problems, "extension_locks", "error",
                 f"stale build lock {lock}: the next JIT build of {lock.parent.name} will hang forever",
                 f"rm {shlex.quote(str(lock))}")
    return {"stale": [str(lock) for lock in stale]}


def _shm_buffers(problems: Problems, older_than_s: float = 600) -> dict[str, Any]:
    """DeepSpeed's CPU all-reduce leaves /dev/shm/deepspeed_allreduce_buffer_* behind (~66 MB per rank
    and job) when a job was not run by a current `dstrain run`, which removes its own. They hold RAM."""
    now = time.time()
    stale = [p for p in Path("/dev/shm").glob("deepspeed_allreduce_buffer_*")
             if now - p.stat().st_mtime > older_than_s]
    total = sum(p.stat().st_size for p in stale)
    if stale:
        _problem(problems, "shm_buffers", "warning",
                 f"{len(stale)} leftover DeepSpeed shared-memory buffers hold {total / 2**30:.1f} GiB of RAM",
                 "with no DeepSpeed job running: rm /dev/shm/deepspeed_allreduce_buffer_*")
    return {"stale": len(stale), "bytes": total}


# --------------------------------------------------------------------------- NVMe


def check_nvme(path: Path, explicit: bool = True) -> tuple[dict[str, Any], Problems]:
    """Probe `path` as an offload directory: writable, O_DIRECT, sequential MB/s.

    Writes and reads back up to PROBE_BYTES (each direction capped at PROBE_BUDGET_S) and
    removes its files. Problems are errors when `explicit` (the user asked for this path).
    """
    problems: Problems = []
    path = Path(path)
    quoted = shlex.quote(str(path))
    info: dict[str, Any] = {
        "path": str(path), "explicit": explicit, "exists": path.exists(), "is_dir": path.is_dir(),
        "writable": False, "filesystem": None, "free_bytes": None, "o_direct": None,
        "test_bytes": 0, "write_mb_s": None, "read_mb_s": None, "error": None,
    }
    if not info["exists"]:
        info["error"] = "does not exist"
        _problem(problems, "nvme", "error", f"NVMe path {path} does not exist", f"mkdir -p {quoted}")
        return info, problems
    if not info["is_dir"]:
        info["error"] = "not a directory"
        _problem(problems, "nvme", "error", f"NVMe path {path} is a file, not a directory",
                 "point --nvme-path (and the config's nvme_path) at a directory")
        return info, problems

    info["filesystem"] = _filesystem_type(path)
    info["free_bytes"] = shutil.disk_usage(path).free
    try:
        written, write_s, read, read_s = _measure_throughput(path)
    except OSError as exc:
        info["error"] = f"{type(exc).__name__}: {exc.strerror or exc}"
        _problem(problems, "nvme", "error", f"cannot write to NVMe path {path}: {info['error']}",
                 f"sudo chown -R $(id -un) {quoted}, or choose a writable directory")
        return info, problems
    info["writable"] = True
    info["test_bytes"] = written
    info["write_mb_s"] = round(written / 1e6 / write_s, 1)
    info["read_mb_s"] = round(read / 1e6 / read_s, 1)
    info["o_direct"] = _supports_o_direct(path)

    if explicit and info["o_direct"] is False:
        _problem(problems, "nvme", "error",
                 f"the filesystem at {path} ({info['filesystem']}) does not support O_DIRECT, "
                 "which DeepSpeed's async_io needs",
                 "choose a directory on a local ext4/xfs disk")
    if explicit and info["filesystem"] == "tmpfs":
        _problem(problems, "nvme", "warning",
                 f"{path} is on tmpfs (RAM): offloading there uses host memory, not a disk",
                 "choose a directory on a local NVMe disk")
    return info, problems


def _measure_throughput(folder: Path) -> tuple[int, float, int, float]:
    """(bytes written, seconds, bytes read, seconds) for a synced sequential write, then read."""
    chunk = os.urandom(PROBE_CHUNK)  # random: compressing filesystems cannot shortcut it
    fd, name = tempfile.mkstemp(prefix=".dstrain-doctor-", dir=folder)
    try:
        written, start = 0, time.perf_counter()
        while written < PROBE_BYTES and (written == 0 or time.perf_counter() - start < PROBE_BUDGET_S):
            written += os.write(fd, chunk)
            os.fsync(fd)
        write_s = time.perf_counter() - start
        os.close(fd)
        fd = -1

        fd = os.open(name, os.O_RDONLY)
        if hasattr(os, "posix_fadvise"):  # drop the cached pages so the read hits the disk
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        buffer = bytearray(PROBE_CHUNK)
        read, start = 0, time.perf_counter()
        while read == 0 or time.perf_counter() - start < PROBE_BUDGET_S:
            n = os.readv(fd, [buffer])
            if n == 0:
                break
            read += n
        read_s = time.perf_counter() - start
    finally:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(name)
    return written, max(write_s, 1e-9), read, max(read_s, 1e-9)


def _supports_o_direct(folder: Path) -> bool | None:
    """Whether an aligned O_DIRECT write works in `folder` (None when the OS has no O_DIRECT)."""
    if not hasattr(os, "O_DIRECT"):
        return None
    name = Path(folder) / f".dstrain-doctor-direct-{os.getpid()}"
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
        try:
            os.write(fd, mmap.mmap(-1, mmap.PAGESIZE))  # mmap memory is page-aligned
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        with contextlib.suppress(OSError):
            name.unlink()


def _filesystem_type(path: Path) -> str | None:
    """Filesystem type of the mount holding `path`, from /proc/self/mounts."""
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    target = os.path.realpath(path)
    best, best_type = "", None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = fields[1].replace("\\040", " ")
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, best_type = mount, fields[2]
    return best_type


# --------------------------------------------------------------------------- output


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


def _yes(flag: Any) -> str:
    return {True: "[green]yes[/]", False: "[red]no[/]"}.get(flag, "?")


def render(report: Report, console: Console) -> None:
    """Print `report` as readable tables, problems (with fixes) last."""
    console.print(_environment_table(report))
    if report.get("gpus"):
        console.print(_gpu_table(report["gpus"]))
    if "ops" in report:
        console.print(_ops_table(report["ops"]))
    if "op_cache" in report:
        console.print(outside(_op_cache_line(report["op_cache"])), soft_wrap=True)
    console.print(_offload_dir_table(report["nvme"]))
    _print_problems(report["problems"], console)


# The tables' str cells are markup: what the report found (versions, paths, names, the environment's
# values, error messages) goes in through outside(); the colours around it are dstrain's.


def _environment_table(report: Report) -> Table:
    versions, host = report["versions"], report["host"]
    env = Table(title="Environment", show_header=False)
    env.add_column(style="bold")
    env.add_column()
    for name in ("python", "torch", "deepspeed", "dstrain"):
        env.add_row(name, outside(versions[name]) if versions[name] else "[red]missing[/]")
    if "cuda" in report:
        cuda = report["cuda"]
        env.add_row("CUDA", f"torch built with {outside(cuda['torch_built_with'] or 'none')}; "
                            f"available: {_yes(cuda['available'])}; nvcc {outside(cuda['nvcc_version'] or 'none')}")
    if "accelerator" in report:
        accel = report["accelerator"]
        env.add_row("DeepSpeed accelerator", outside(f"{accel['name']} ({accel['communication_backend']})"))
    env.add_row("host RAM", f"{_gib(host['ram_available_bytes'])} available of {_gib(host['ram_total_bytes'])}")
    env.add_row("CPUs", f"{host['cpus_usable']} usable of {host['cpu_count']}")
    env.add_row("/dev/shm", _gib(host["shm_total_bytes"]))
    libaio = report["libaio"]
    env.add_row("libaio", _yes(libaio["ok"]) + outside(f" ({libaio['header'] or 'no header'}, "
                                                       f"{libaio['dev_library'] or 'no libaio.so'})"))
    bytecode = report["bytecode"]
    env.add_row("torch bytecode", f"none installed, none written: `dstrain run` keeps it in "
                f"{outside(bytecode['dstrain_cache'])}" if bytecode["dstrain_cache"]
                else f"kept in {outside(bytecode['prefix'])}" if bytecode["prefix"] else "kept")
    arch = report["torch_cuda_arch_list"]
    env.add_row(ARCH_LIST_VAR, outside(str(arch["value"]) + (f" -> {arch['sanitized']}" if arch["sanitized"] else "")))
    return env


def _gpu_table(gpu_facts: list[dict]) -> Table:
    gpus = Table(title="GPUs")
    for column in ("#", "name", "memory", "compute capability", "bf16"):
        gpus.add_column(column)
    for gpu in gpu_facts:
        gpus.add_row(str(gpu["index"]), outside(gpu["name"]), _gib(gpu["total_memory_bytes"]),
                     outside(gpu["compute_capability"]), _yes(gpu["bf16"]))
    return gpus


def _ops_table(op_facts: dict) -> Table:
    ops = Table(title="DeepSpeed ops")
    for column in ("op", "compatible", "prebuilt", "JIT cached", "used for"):
        ops.add_column(column)
    for name, op in op_facts.items():
        ops.add_row(outside(name), _yes(op["compatible"]), _yes(op["installed"]), _yes(op["jit_cached"]),
                    KEY_OPS.get(name, ""))
    return ops


def _op_cache_line(cache: dict) -> str:
    built = ", ".join(cache["built"]) if cache["built"] else "none yet (the first run builds what it needs)"
    whose = ("dstrain's own for this Python environment and its torch and DeepSpeed versions"
             if cache["private"] else "TORCH_EXTENSIONS_DIR, as you set it")
    return f"Op build cache: {cache['path']} ({whose}). Built: {built}."


def _offload_dir_table(nvme: dict) -> Table:
    disk = Table(title="Offload directory" + ("" if nvme["explicit"] else " (system temp dir)"),
                 show_header=False)
    disk.add_column(style="bold")
    disk.add_column()
    disk.add_row("path", outside(nvme["path"]))
    disk.add_row("writable", _yes(nvme["writable"]) + (f" ({outside(nvme['error'])})" if nvme["error"] else ""))
    if nvme["writable"]:
        disk.add_row("filesystem", f"{outside(nvme['filesystem'])}, {_gib(nvme['free_bytes'])} free, "
                                   f"O_DIRECT: {_yes(nvme['o_direct'])}")
        disk.add_row("sequential", f"write {nvme['write_mb_s']} MB/s, read {nvme['read_mb_s']} MB/s "
                                   f"({nvme['test_bytes'] // 2**20} MiB, synced)")
    return disk


def _print_problems(problems: list[dict], console: Console) -> None:
    if not problems:
        console.print("[bold green]No problems found: this machine can train.[/]")
        return
    table = Table(title="Problems")
    for column in ("severity", "check", "problem", "fix"):
        table.add_column(column)
    for p in problems:
        colour = "red" if p["severity"] == "error" else "yellow"
        table.add_row(f"[{colour}]{p['severity']}[/]", outside(p["check"]), outside(p["message"]), outside(p["fix"]))
    console.print(table)
    errors = sum(p["severity"] == "error" for p in problems)
    if errors:
        console.print(f"[bold red]{errors} error(s): fix them before training.[/]")
    else:
        console.print("[bold yellow]Only warnings: this machine can train.[/]")


class _StderrProxy(io.TextIOBase):
    """Stands in for stdout: forwards to whatever sys.stderr is at write time.

    DeepSpeed's logger keeps the stream it saw at import; handing it this proxy keeps its
    warnings off stdout without tying it to a stream that may later be closed.
    """

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def fileno(self) -> int:
        return sys.stderr.fileno()


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Send everything written to stdout, by Python or by child processes, to stderr."""
    original = sys.stdout
    original.flush()
    try:
        saved_fd = os.dup(1)
        os.dup2(2, 1)
    except OSError:  # no usable fd 1: Python-level redirection still applies
        saved_fd = None
    try:
        with contextlib.redirect_stdout(_StderrProxy()):
            yield
    finally:
        with contextlib.suppress(Exception):
            original.flush()  # whatever cached the real stdout meanwhile still lands on stderr
        if saved_fd is not None:
            os.dup2(saved_fd, 1)
            os.close(saved_fd)


def main(json_output: bool = False, nvme_path: Path | None = None) -> int:
    """Run the checks and print the report; 0 when nothing is an error, else 1.

    With `json_output`, stdout carries only the JSON report.
    """
    with _stdout_to_stderr():
        report = collect(nvme_path)
    if json_output:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
        sys.stdout.flush()
    else:
        render(report, Console())
    return 1 if any(p["severity"] == "error" for p in report["problems"]) else 0
