"""The command that starts the ranks (DeepSpeed's launcher, with dstrain.rank.worker as the module)
and the environment they inherit.

Every flag here is DeepSpeed's own; the ranks get nothing but the run directory, positional, so the
launcher's abbreviated-flag parsing never sees one of ours. A job on this machine alone starts
DeepSpeed's per-node launcher (`deepspeed.launcher.launch`) directly: DeepSpeed's runner would only
compute the same world description and start it, at the cost of one more Python process that
imports torch and DeepSpeed (3.7 s on an H200 machine).
"""

from __future__ import annotations

import base64
import json
import os
import sys
from pathlib import Path

from rich.console import Console

from dstrain.launcher.options import LaunchOptions
from dstrain.launcher.run_directory import SYNTHETIC_HOSTFILE
from dstrain.launcher.topology import MPI_LAUNCHERS


WORKER_MODULE = "dstrain.rank.worker"
WORKER_FILE = str(Path(__file__).resolve().parents[1] / "rank" / "worker.py")


def runner_command(o: LaunchOptions, ranks: int, nodes: int, run_dir: Path, port: int) -> list[str]:
    """The command that starts every rank of this node (all nodes' ranks, for ssh/MPI backends)."""
    if is_local_job(o, nodes):
        return local_launch_command(o, ranks, run_dir, port)
    cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.runner"]
    hostfile = o.hostfile
    if o.no_ssh and nodes > 1 and hostfile is None:
        hostfile = run_dir / SYNTHETIC_HOSTFILE  # written by launch(); see write_synthetic_hostfile
    cmd += ["--hostfile", str(hostfile) if hostfile else str(run_dir / "no-hostfile")]
    if o.include or o.exclude:
        cmd += ["--include", o.include] if o.include else ["--exclude", o.exclude]
    elif not (o.launcher in MPI_LAUNCHERS and hostfile):
        cmd += ["--num_gpus", str(ranks), "--num_nodes", str(nodes)]
    cmd += ["--master_port", str(port)]
    if o.master_addr:
        cmd += ["--master_addr", o.master_addr]
    if o.launcher:
        cmd += ["--launcher", o.launcher]
    if o.no_ssh:
        cmd += ["--no_ssh", "--node_rank", str(o.node_rank or 0)]
    if not o.verbose:
        cmd += ["--log_level", "warning"]
    # The run directory is the only argument, positional: the runner never mistakes it for a flag.
    # DeepSpeed's slurm backend drops --module (it runs `python -u SCRIPT`), so it gets the file.
    worker = [WORKER_FILE] if o.launcher == "slurm" else ["--module", WORKER_MODULE]
    return cmd + worker + [str(run_dir.resolve())]


def is_local_job(o: LaunchOptions, nodes: int) -> bool:
    """One node, this one, with no hostfile, backend or device filter for DeepSpeed's runner to apply."""
    return nodes == 1 and not (o.hostfile or o.launcher or o.no_ssh or o.include or o.exclude)


def local_devices(ranks: int) -> list:
    """The device ids of this node's ranks: the first `ranks` of CUDA_VISIBLE_DEVICES when it lists
    that many (DeepSpeed's runner ignores it once told a GPU count, and dstrain always tells one),
    else 0..ranks-1."""
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if len(visible) >= ranks:
        return [int(d) if d.isdigit() else d for d in visible[:ranks]]
    return list(range(ranks))


def local_launch_command(o: LaunchOptions, ranks: int, run_dir: Path, port: int) -> list[str]:
    """DeepSpeed's per-node launcher, started as DeepSpeed's runner would start it for one node."""
    world_info = base64.urlsafe_b64encode(json.dumps({"localhost": local_devices(ranks)}).encode()).decode()
    cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world_info}",
           "--master_addr", "127.0.0.1", "--master_port", str(port), f"--log_level={'info' if o.verbose else 'warning'}"]
    return cmd + ["--module", WORKER_MODULE, str(run_dir.resolve())]


def rank_env(accelerator: str, ranks: int) -> dict[str, str]:
    from dstrain.launcher.env_fixes import sanitize_cuda_arch_list, use_private_op_cache
    env, note = sanitize_cuda_arch_list(os.environ)
    if note:
        Console(stderr=True).print(f"[yellow]note:[/] {note}")
    use_private_op_cache(env, accelerator)
    env["DS_ACCELERATOR"] = accelerator
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ranks)))
    env["PYTHONUNBUFFERED"] = "1"
    cwd = str(Path.cwd())  # user entry points next to the config import in every rank
    env["PYTHONPATH"] = cwd + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env
