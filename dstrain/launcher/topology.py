"""The job's shape: nodes, ranks per node, hosts, the ranks this process starts, the master port.

Reads the hostfile and the flags, checks their combinations (with the fix for each), and works
out the world size exactly as the deepspeed runner will from the same flags. Nothing is written.
"""

from __future__ import annotations

import random
import re
import socket
from dataclasses import dataclass
from pathlib import Path

from dstrain.errors import Problem, UserError
from dstrain.hardware import default_ranks_per_node
from dstrain.launcher.options import LaunchOptions


LAUNCHERS = ("pdsh", "openmpi", "mvapich", "slurm", "mpich", "impi")


# DeepSpeed's MPI backends run every slot of every hostfile host: they refuse --num_gpus/--num_nodes
# and --include/--exclude, and their ranks find each other through mpi4py.
MPI_LAUNCHERS = ("openmpi", "mpich", "impi", "mvapich")


MULTI_NODE_PORT = 29500  # with --no-ssh every node must agree on the port without talking: a fixed default


def read_hostfile(path: Path) -> dict[str, int]:
    """DeepSpeed's hostfile: 'hostname slots=N' per line, '#' comments. Checked here for a clear error."""
    try:
        lines = path.read_text().splitlines()
    except OSError as err:
        raise UserError.single(f"cannot read hostfile: {err.strerror}", f"--hostfile {path}",
                               "give a file with one 'hostname slots=N' line per node")
    hosts: dict[str, int] = {}
    problems = []
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"(\S+)\s+slots\s*=\s*(\d+)", line)
        if not match or int(match.group(2)) < 1:
            problems.append(Problem(f"line {number} {raw!r} is not 'hostname slots=N' (N >= 1)",
                                    f"--hostfile {path}", "e.g. 'worker-0 slots=8'"))
            continue
        if match.group(1) in hosts:
            problems.append(Problem(f"line {number}: host {match.group(1)!r} listed twice", f"--hostfile {path}",
                                    "list each host once"))
        hosts[match.group(1)] = int(match.group(2))
    if not hosts and not problems:
        problems.append(Problem("no hosts listed", f"--hostfile {path}", "add 'hostname slots=N' lines"))
    if problems:
        raise UserError(problems)
    return hosts


def topology(o: LaunchOptions, accelerator: str) -> tuple[int, int, dict[str, int] | None]:
    """(ranks per node, nodes, hosts) from the flags and the hostfile."""
    if o.launcher and o.launcher not in LAUNCHERS:
        raise UserError.single(f"unknown launcher {o.launcher!r}", "--launcher", "use one of " + ", ".join(LAUNCHERS))
    if o.gpus is not None and o.gpus < 1 or o.nodes is not None and o.nodes < 1:
        raise UserError.single("must be at least 1", "--gpus/--nodes", "e.g. --gpus 8 --nodes 2")
    requested = o.nodes or 1
    if o.no_ssh and o.node_rank is None and requested > 1:
        raise UserError.single("--no-ssh with several nodes needs this node's rank", "--node-rank",
                               "run once per node with --node-rank 0, 1, ...")
    if o.node_rank is not None and not o.no_ssh:
        raise UserError.single("--node-rank is only used with --no-ssh", "--node-rank",
                               "add --no-ssh (run once per node), or drop --node-rank and let the launcher "
                               "start every node from the hostfile")
    if o.node_rank is not None and not 0 <= o.node_rank < requested:
        raise UserError.single(f"node rank {o.node_rank} is not in 0..{requested - 1}", "--node-rank",
                               "use 0 for the first node; --nodes gives the count")
    if o.no_ssh and requested > 1 and not o.master_addr:
        raise UserError.single("--no-ssh with several nodes needs the address of node rank 0", "--master-addr",
                               "give the same --master-addr (node 0's IP or hostname) on every node")
    if o.include and o.exclude:
        raise UserError.single("--include and --exclude cannot be combined", "--include/--exclude",
                               "use one of them")
    if (o.include or o.exclude) and (o.gpus is not None or o.nodes is not None):
        raise UserError.single("--include/--exclude choose the hosts and slots: DeepSpeed refuses them with "
                               "--gpus/--nodes", "--include/--exclude", "drop --gpus and --nodes")
    if requested > 1 and not o.hostfile and not o.no_ssh:
        raise UserError.single(f"--nodes {requested} needs the hosts to start", "--nodes",
                               "give --hostfile (one 'host slots=N' line per node), or run dstrain once per "
                               "node with --no-ssh --node-rank R --master-addr ADDR")
    if o.launcher in MPI_LAUNCHERS and o.hostfile and (o.gpus is not None or o.nodes is not None or o.include or o.exclude):
        raise UserError.single(f"the {o.launcher} launcher runs every slot of every host in the hostfile; DeepSpeed "
                               "refuses --gpus/--nodes/--include/--exclude with it", f"--launcher {o.launcher}",
                               "write the hosts and slots=N to use in the hostfile, and drop those flags")
    hosts = read_hostfile(o.hostfile) if o.hostfile else None
    nodes = o.nodes if o.nodes is not None else (len(hosts) if hosts and not o.no_ssh else 1)
    if hosts and nodes > len(hosts):
        raise UserError.single(f"--nodes {nodes} but the hostfile lists {len(hosts)} hosts", f"--hostfile {o.hostfile}",
                               "add hosts or lower --nodes")
    ranks = o.gpus or (min(hosts.values()) if hosts else default_ranks_per_node(accelerator))
    return ranks, nodes, hosts


def active_hosts(o: LaunchOptions, ranks: int, nodes: int, hosts: dict[str, int] | None,
                  accelerator: str) -> dict[str, int]:
    """Host -> ranks it runs, in node-rank order, as the deepspeed runner will work it out from the
    same flags. The world size is the sum; --include/--exclude make it differ from ranks x nodes."""
    if hosts and o.launcher in MPI_LAUNCHERS:
        return dict(hosts)
    if not (o.include or o.exclude):
        if hosts:
            return {host: ranks for host in list(hosts)[:nodes]}
        return {f"node{i}": ranks for i in range(nodes)}  # one node, or the --no-ssh synthetic hostfile
    pool = hosts or {"localhost": default_ranks_per_node(accelerator)}
    from deepspeed.launcher.runner import parse_inclusion_exclusion
    flag = "--include" if o.include else "--exclude"
    try:
        active = parse_inclusion_exclusion(pool, o.include or "", o.exclude or "")
    except ValueError as err:
        raise UserError.single(str(err), f"{flag} {o.include or o.exclude}",
                               "name hosts of the hostfile and slots below their slots=N, e.g. 'worker-0:0,1@worker-1'")
    active = {host: len(slots) for host, slots in active.items() if slots}
    if not active:
        raise UserError.single("no host or slot is left to run on", f"{flag} {o.include or o.exclude}",
                               "leave at least one slot")
    return active


def own_ranks(o: LaunchOptions, active: dict[str, int]) -> range | None:
    """The global ranks this `dstrain run` starts: with --no-ssh, only this node's; otherwise all (None)."""
    if not o.no_ssh:
        return None
    counts = list(active.values())
    first = sum(counts[:o.node_rank or 0])
    return range(first, first + counts[o.node_rank or 0])


def free_port() -> int:
    """A port free now and out of the kernel's range for outgoing connections: the rendezvous binds it
    seconds later (the ranks start while the checks run), and a port from that range can meanwhile be
    taken by any connection this host opens (seen once on a GPU machine: EADDRINUSE in a rank)."""
    low, _high = _ephemeral_range()
    for port in random.Random().sample(range(20000, low), k=min(64, max(0, low - 20000))):
        if _bindable(port):
            return port
    with socket.socket() as sock:  # no such port free: let the kernel pick one
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("", port))  # every address, as the rendezvous store listens
        except OSError:
            return False
    return True


@dataclass
class JobShape:
    ranks: int                 # ranks per node (--gpus)
    nodes: int
    hosts: dict[str, int] | None  # the hostfile's hosts and slots, if one was given
    active: dict[str, int]     # host -> ranks it runs, in node-rank order
    own_ranks: range | None    # the global ranks this process starts (--no-ssh), None: all

    @property
    def world(self) -> int:
        return sum(self.active.values())


def job_shape(o: LaunchOptions, accelerator: str) -> JobShape:
    """Check the flags and the hostfile and work out the job's shape."""
    ranks, nodes, hosts = topology(o, accelerator)
    active = active_hosts(o, ranks, nodes, hosts, accelerator)
    return JobShape(ranks, nodes, hosts, active, own_ranks(o, active))


def master_port(o: LaunchOptions, shape: JobShape) -> int:
    """--master-port, else a fixed port every --no-ssh node agrees on, else a free local port."""
    return o.master_port or (MULTI_NODE_PORT if o.no_ssh and shape.nodes > 1 else free_port())
