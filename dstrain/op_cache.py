"""dstrain's own folder for DeepSpeed's JIT op builds, keyed by what a build depends on.

Both sides use it: `dstrain run` points the ranks it starts here, and each rank points itself here too,
since a node that pdsh, mpirun or srun started gets none of the launching machine's variables. Cheap to
import: no torch or deepspeed.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path

OP_CACHE_VAR = "TORCH_EXTENSIONS_DIR"


def op_cache_key(accelerator: str) -> dict[str, str]:
    """What an op build depends on beyond its name: the Python environment, the torch and DeepSpeed
    versions, and the accelerator (DeepSpeed names an op's CPU and CUDA builds alike: fused_adam)."""
    from importlib import metadata

    def version(package: str) -> str:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return "none"
    return {"environment": os.path.realpath(sys.prefix), "python": sys.version.split()[0],
            "torch": version("torch"), "deepspeed": version("deepspeed"), "accelerator": accelerator}


def private_op_cache(env: Mapping[str, str], accelerator: str) -> Path:
    """This environment's own folder for torch's JIT op builds: ~/.cache/dstrain/torch_extensions/<key>.

    torch keys a JIT build by the op's name alone, so two Python environments with the same torch shared
    ~/.cache/torch_extensions and each rewrote the other's build files: every start rebuilt the ops
    (142-193 s of imports and 455 s to the first step in a newcomer's venv, against 15-18 s with its own
    folder; issue 38). A CPU rank on a GPU host likewise loaded the CUDA fused_adam a GPU run had built.
    """
    key = op_cache_key(accelerator)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    cache = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "dstrain" / "torch_extensions" / f"{accelerator}-{digest}"


def op_cache(env: Mapping[str, str], accelerator: str) -> tuple[Path, bool]:
    """(the folder op builds go to, whether it is dstrain's private one): TORCH_EXTENSIONS_DIR when the
    user set it, else private_op_cache."""
    if env.get(OP_CACHE_VAR):
        return Path(env[OP_CACHE_VAR]), False
    return private_op_cache(env, accelerator), True


def use_private_op_cache(env: dict[str, str], accelerator: str) -> Path:
    """Point `env` (the ranks' environment, or this process's) at the op cache; a TORCH_EXTENSIONS_DIR
    the user set is kept. The folder records what it is keyed by (environment.json), for `doctor`."""
    folder, private = op_cache(env, accelerator)
    if private:
        env[OP_CACHE_VAR] = str(folder)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            record = folder / "environment.json"
            if not record.exists():
                record.write_text(json.dumps(op_cache_key(accelerator), indent=2) + "\n")
        except OSError:
            pass  # torch creates it at the first build, or says why it cannot
    return folder


def built_ops(folder: Path) -> list[str]:
    """The ops built in an op cache folder: each subfolder holding its loadable .so."""
    if not folder.is_dir():
        return []
    return sorted(d.name for d in folder.iterdir() if d.is_dir() and (d / f"{d.name}.so").is_file())


def remember_cpu_info(folder: Path) -> None:
    """Answer py-cpuinfo's `get_cpu_info()` from a file in the op cache `folder`, written by the first
    process that asks on this machine since it booted.

    DeepSpeed asks it twice for every op it loads (march and SIMD flags), and each answer is a fresh
    Python subprocess: about 1 s of CPU, 3 to 6 times per rank start on CPU ranks (comm op, Adam).
    The CPU does not change while the machine runs, so the file is keyed by host name and boot id (a
    home folder shared by several nodes keeps one file per node). Without py-cpuinfo, or without a boot
    id, nothing changes."""
    try:
        import cpuinfo
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except (ImportError, OSError):
        return
    if getattr(cpuinfo.get_cpu_info, "remembered", False):
        return
    import socket
    record = folder / f"cpu_info-{socket.gethostname()}-{boot_id}.json"
    ask = cpuinfo.get_cpu_info

    def get_cpu_info() -> dict:
        try:
            return json.loads(record.read_text())
        except (OSError, ValueError):
            pass
        info = ask()
        try:
            folder.mkdir(parents=True, exist_ok=True)
            partial = record.with_name(f"{record.name}.{os.getpid()}.tmp")
            partial.write_text(json.dumps(info))
            partial.replace(record)  # whole or absent, for a rank reading it at the same moment
        except OSError:
            pass
        return info

    get_cpu_info.remembered = True
    cpuinfo.get_cpu_info = get_cpu_info
