"""The command that starts the ranks (DeepSpeed's launcher, with dstrain.rank.worker as the module)
and the environment they inherit.

Every flag here is DeepSpeed's own; the ranks get nothing but the run directory, positional, so the
launcher's abbreviated-flag parsing never sees one of ours. A job on this machine alone, and each node
of a --no-ssh job, starts DeepSpeed's per-node launcher (`deepspeed.launcher.launch`) directly:
DeepSpeed's runner would only compute the same world description and start it, at the cost of one
more Python process that imports torch and DeepSpeed (3.7 s on an H200 machine), and for --no-ssh it
would give this node devices 0..N-1 whatever CUDA_VISIBLE_DEVICES says.
"""

from __future__ import annotations

import base64
import json
import os
import sys
from pathlib import Path

from rich.console import Console

from dstrain.console_text import outside
from dstrain.launcher.options import LaunchOptions
from dstrain.launcher.topology import MPI_LAUNCHERS, JobShape


WORKER_MODULE = "dstrain.rank.worker"
WORKER_FILE = str(Path(__file__).resolve().parents[1] / "rank" / "worker.py")


def runner_command(o: LaunchOptions, shape: JobShape, run_dir: Path, port: int) -> list[str]:
    """The command that starts every rank of this node (all nodes' ranks, for ssh/MPI backends)."""
    if is_local_job(o, shape.nodes):
        return per_node_launch_command(o, {"localhost": local_devices(shape.ranks)}, 0, "127.0.0.1", run_dir, port)
    if o.no_ssh:
        return per_node_launch_command(o, no_ssh_world_info(o, shape), o.node_rank or 0,
                                       o.master_addr or "127.0.0.1", run_dir, port)
    cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.runner"]
    hostfile = o.hostfile
    cmd += ["--hostfile", str(hostfile) if hostfile else str(run_dir / "no-hostfile")]
    if o.include or o.exclude:
        cmd += ["--include", o.include] if o.include else ["--exclude", o.exclude]
    elif not (o.launcher in MPI_LAUNCHERS and hostfile):
        cmd += ["--num_gpus", str(shape.ranks), "--num_nodes", str(shape.nodes)]
    cmd += ["--master_port", str(port)]
    if o.master_addr:
        cmd += ["--master_addr", o.master_addr]
    if o.launcher:
        cmd += ["--launcher", o.launcher]
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


def no_ssh_world_info(o: LaunchOptions, shape: JobShape) -> dict[str, list]:
    """--no-ssh: every node's host and device ids, in node-rank order, as DeepSpeed's runner would pass
    them to its per-node launcher, except that this node's devices are those CUDA_VISIBLE_DEVICES lists
    (the runner, told a GPU count, gives every node 0..N-1: two nodes on one host took the same GPUs).
    Another node's ids only count its ranks; that node picks its own devices."""
    if (o.include or o.exclude) and shape.hosts:  # the hostfile's slots, as filtered: device ids already
        from deepspeed.launcher.runner import parse_inclusion_exclusion
        slots = parse_inclusion_exclusion(shape.hosts, o.include or "", o.exclude or "")
        return {host: list(slots[host]) for host in shape.active}
    hosts = list(shape.active)
    info = {host: list(range(count)) for host, count in shape.active.items()}
    this_node = hosts[o.node_rank or 0]
    info[this_node] = local_devices(shape.active[this_node])
    return info


def per_node_launch_command(o: LaunchOptions, world_info: dict[str, list], node_rank: int, master_addr: str,
                            run_dir: Path, port: int) -> list[str]:
    """DeepSpeed's per-node launcher, started as DeepSpeed's runner would start it for this node."""
    encoded = base64.urlsafe_b64encode(json.dumps(world_info).encode()).decode()
    cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={encoded}",
           "--master_addr", master_addr, "--master_port", str(port)]
    if node_rank or len(world_info) > 1:
        cmd.append(f"--node_rank={node_rank}")
    cmd.append(f"--log_level={'info' if o.verbose else 'warning'}")
    return cmd + ["--module", WORKER_MODULE, str(run_dir.resolve())]


def rank_env(accelerator: str, ranks: int) -> dict[str, str]:
    from dstrain.launcher.env_fixes import sanitize_cuda_arch_list
    from dstrain.op_cache import use_private_op_cache
    env, note = sanitize_cuda_arch_list(os.environ)
    if note:
        Console(stderr=True).print(f"[yellow]note:[/] {outside(note)}")  # quotes TORCH_CUDA_ARCH_LIST
    use_private_op_cache(env, accelerator)
    env["DS_ACCELERATOR"] = accelerator
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ranks)))
    env["PYTHONUNBUFFERED"] = "1"
    cwd = str(Path.cwd())  # user entry points next to the config import in every rank
    env["PYTHONPATH"] = cwd + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env
