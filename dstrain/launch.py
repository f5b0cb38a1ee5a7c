"""`dstrain run`: resolve and check everything, write the run directory, start the ranks through
the real `deepspeed` launcher, and supervise them.

Order matters for the user: every check that can fail on bad input (config, DeepSpeed's own
models, the model and data entry points, the hostfile, the checkpoint to resume) runs before
anything is written or spawned, so a typo costs seconds, not a GPU allocation.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from rich.console import Console

from dstrain import __version__
from dstrain.checkpoint import CHECKPOINTS, complete_checkpoints, find_resume
from dstrain.config.layers import flatten
from dstrain.config.resolve import ResolvedConfig, redact, resolve
from dstrain.errors import Problem, UserError
from dstrain.hardware import default_ranks_per_node, resolve_accelerator
from dstrain.worker import RANKS_DIR

LAUNCHERS = ("pdsh", "openmpi", "mvapich", "slurm", "mpich", "impi")
# DeepSpeed's MPI backends run every slot of every hostfile host: they refuse --num_gpus/--num_nodes
# and --include/--exclude, and their ranks find each other through mpi4py.
MPI_LAUNCHERS = ("openmpi", "mpich", "impi", "mvapich")
MULTI_NODE_PORT = 29500  # with --no-ssh every node must agree on the port without talking: a fixed default
STOP_GRACE_S = 110  # a preempted job must be gone within 120 s; ranks get this long to save
_RUNNER_NOISE = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,]+\] \[(INFO|DEBUG)\]|Setting accelerator to CPU|"
                           r"Unable to find hostfile|get learning rate from scheduler before it has started")


@dataclass
class LaunchOptions:
    preset: str | None = None
    config_file: Path | None = None
    sets: list[str] = field(default_factory=list)
    gpus: int | None = None
    nodes: int | None = None  # not given: every host of the hostfile, else one node
    hostfile: Path | None = None
    include: str | None = None
    exclude: str | None = None
    master_port: int | None = None
    master_addr: str | None = None
    launcher: str | None = None
    node_rank: int | None = None
    no_ssh: bool = False
    accelerator: str = "auto"
    run_dir: Path | None = None
    resume: str | None = None
    dry_run: bool = False
    verbose: bool = False


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


def _topology(o: LaunchOptions, accelerator: str) -> tuple[int, int, dict[str, int] | None]:
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


def _active_hosts(o: LaunchOptions, ranks: int, nodes: int, hosts: dict[str, int] | None,
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


def _own_ranks(o: LaunchOptions, active: dict[str, int]) -> range | None:
    """The global ranks this `dstrain run` starts: with --no-ssh, only this node's; otherwise all (None)."""
    if not o.no_ssh:
        return None
    counts = list(active.values())
    first = sum(counts[:o.node_rank or 0])
    return range(first, first + counts[o.node_rank or 0])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _fit_nvme_swap_buffer(resolved: ResolvedConfig, largest: int) -> None:
    """NVMe parameter offload swaps through buffers of offload_param.buffer_size elements, and DeepSpeed
    fails mid-start when one parameter (a large embedding, say) does not fit one: grow it to fit."""
    offload = (resolved.ds_config.get("zero_optimization") or {}).get("offload_param") or {}
    if offload.get("device") == "nvme" and int(offload.get("buffer_size", 100_000_000)) < largest:
        offload["buffer_size"] = largest
        resolved.warnings.append(f"deepspeed.zero_optimization.offload_param.buffer_size raised to {largest:,}: "
                                 "the model's largest parameter must fit one NVMe swap buffer")


def _check_runtime(resolved: ResolvedConfig) -> int:
    """Checks that import DeepSpeed/torch: DeepSpeed's config models, the model (built on the meta
    device: no memory) and the data source. Returns the parameter count."""
    from dstrain.config import deepspeed_models
    problems = deepspeed_models.validate(resolved.ds_config)
    if problems:
        raise UserError(problems)
    from dstrain.estimate import count_model
    from dstrain.models import model_builder
    build = model_builder(resolved.config)
    try:
        params, largest = count_model(build)
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001 - a user model that cannot be built is bad input
        raise UserError.single(f"building the model failed: {type(err).__name__}: {err}", "model",
                               "check model.name and model.kwargs")
    _check_data(resolved)
    _fit_nvme_swap_buffer(resolved, largest)
    return params


def _check_data(resolved: ResolvedConfig) -> None:
    from dstrain.data import check_source
    check_source(resolved.config)


def _default_run_dir(resolved: ResolvedConfig) -> Path:
    return Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{resolved.preset or 'custom'}"


def _prepare_run_dir(run_dir: Path, resuming: bool) -> None:
    if not resuming and complete_checkpoints(run_dir / CHECKPOINTS):
        raise UserError.single("this run directory already holds checkpoints", f"--run-dir {run_dir}",
                               "continue it with --resume latest, or choose another --run-dir")
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError.single("is a file, not a directory", f"--run-dir {run_dir}",
                               "name a directory (it is created if missing)")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write_test{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise UserError.single(f"cannot write the run directory: {err.strerror}", f"--run-dir {run_dir}",
                               "choose a writable directory with free space")


def _write_run_dir(run_dir: Path, resolved: ResolvedConfig, launch_info: dict, own_ranks: range | None = None) -> None:
    from dstrain.checkpoint import write_atomic
    config = resolved.config.model_dump(mode="json")
    secrets = {path: value for path, value in flatten(resolved.ds_config).items()
               if flatten(redact(resolved.ds_config)).get(path) != value}
    try:
        write_atomic(run_dir / "config.yaml", yaml.safe_dump(redact(config), sort_keys=False))
        write_atomic(run_dir / "ds_config.json", json.dumps(redact(resolved.ds_config), indent=2))
        write_atomic(run_dir / "launch.json", json.dumps(launch_info, indent=2))
        if secrets:
            secret_file = run_dir / ".secrets.json"
            write_atomic(secret_file, json.dumps(secrets))
            secret_file.chmod(0o600)
        (run_dir / RANKS_DIR).mkdir(exist_ok=True)
        for stale in (run_dir / RANKS_DIR).glob("rank*"):
            # With --no-ssh, other nodes sharing this directory may already have started: their
            # records are theirs to replace. Ranks past the new world size belong to no node.
            rank = int(stale.name[4:].split(".")[0])
            if own_ranks is None or rank in own_ranks or rank >= launch_info["world_size"]:
                stale.unlink(missing_ok=True)
    except OSError as err:
        raise UserError.single(f"cannot write the run directory: {err.strerror}", f"--run-dir {run_dir}",
                               "choose a writable directory with free space")


def _universal_copy(checkpoints: Path, tag: str, run_dir: Path) -> Path:
    """The universal form of one checkpoint, converted on first use and reused after."""
    from dstrain.convert import to_universal
    target = (run_dir / "universal").resolve()
    if not (target / tag).is_dir():
        Console(highlight=False).print(f"converting {tag} to a universal checkpoint in {target} ...")
        to_universal(checkpoints, target, tag=tag)
    return target


def _runner_command(o: LaunchOptions, ranks: int, nodes: int, run_dir: Path, port: int) -> list[str]:
    cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.runner"]
    hostfile = o.hostfile
    if o.no_ssh and nodes > 1 and hostfile is None:
        hostfile = run_dir / SYNTHETIC_HOSTFILE  # written by launch(); see _write_synthetic_hostfile
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
    worker = [WORKER_FILE] if o.launcher == "slurm" else ["--module", "dstrain.worker"]
    return cmd + worker + [str(run_dir.resolve())]


SYNTHETIC_HOSTFILE = "hostfile"
WORKER_FILE = str(Path(__file__).resolve().parent / "worker.py")


def _write_synthetic_hostfile(run_dir: Path, ranks: int, nodes: int) -> None:
    """--no-ssh without --hostfile: the runner only needs the job's shape, one line per node. Every
    node writes the same text; atomically, since another node's runner may be reading it."""
    from dstrain.checkpoint import write_atomic
    write_atomic(run_dir / SYNTHETIC_HOSTFILE, "".join(f"node{i} slots={ranks}\n" for i in range(nodes)))


def _clear_stale_build_locks(console: Console, dry_run: bool) -> None:
    """An op build killed mid-way leaves torch's lock file behind, and every later build of that op
    then waits for it forever, silently, inside the ranks. Such locks go before the ranks start."""
    from dstrain.env_fixes import stale_extension_locks
    for lock in stale_extension_locks():
        if dry_run:
            console.print(f"[yellow]note:[/] stale op build lock {lock} (left by a killed build); a run removes it")
            continue
        try:
            lock.unlink(missing_ok=True)
        except OSError as err:
            raise UserError.single(f"stale op build lock {lock} cannot be removed ({err}): the ranks would wait "
                                   "on it forever", "TORCH_EXTENSIONS_DIR", f"rm {shlex.quote(str(lock))}")
        console.print(f"[yellow]note:[/] removed stale op build lock {lock} (left by a killed build)")


def _rank_env(accelerator: str, ranks: int) -> dict[str, str]:
    from dstrain.env_fixes import sanitize_cuda_arch_list
    env, note = sanitize_cuda_arch_list(os.environ)
    if note:
        Console(stderr=True).print(f"[yellow]note:[/] {note}")
    env["DS_ACCELERATOR"] = accelerator
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ranks)))
    env["PYTHONUNBUFFERED"] = "1"
    cwd = str(Path.cwd())  # user entry points next to the config import in every rank
    env["PYTHONPATH"] = cwd + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def launch(o: LaunchOptions) -> int:
    console = Console(highlight=False)
    accelerator = resolve_accelerator(o.accelerator)
    os.environ["DS_ACCELERATOR"] = accelerator  # DeepSpeed, imported for the checks below, asks no more
    if o.accelerator not in ("auto", "cuda", "cpu"):
        raise UserError.single(f"unknown accelerator {o.accelerator!r}", "--accelerator", "use auto, cuda or cpu")
    ranks, nodes, hosts = _topology(o, accelerator)
    active = _active_hosts(o, ranks, nodes, hosts, accelerator)
    world = sum(active.values())
    own_ranks = _own_ranks(o, active)
    if o.launcher and len(active) == 1:
        console.print(f"[yellow]warning:[/] --launcher {o.launcher} is not used: one node runs locally "
                      "(the launcher starts several nodes from a --hostfile)", soft_wrap=True)
    elif o.launcher in (*MPI_LAUNCHERS, "slurm") and importlib.util.find_spec("mpi4py") is None:
        console.print(f"[yellow]warning:[/] ranks started by {o.launcher} find each other through mpi4py, which is "
                      "not installed here: pip install mpi4py (on every node)", soft_wrap=True)
    preset = o.preset
    if preset and preset.strip().lower() == "auto":
        from dstrain.planner import choose_preset
        preset, reason = choose_preset(o.config_file, o.sets, ranks, nodes, accelerator)
        console.print(f"--preset auto: {preset} ({reason})")
    resolved = resolve(preset, o.config_file, o.sets, world_size=world, accelerator=accelerator)
    params = _check_runtime(resolved)
    for warning in resolved.warnings:
        console.print(f"[yellow]warning:[/] {warning}", soft_wrap=True)

    run_dir = o.run_dir or _default_run_dir(resolved)
    resume_info, notes = None, []
    if o.resume:
        found, notes = find_resume(o.resume, run_dir)
        saved_hash = found.mark.get("config_hash")
        if saved_hash and saved_hash != resolved.config_hash():
            raise UserError.single(f"checkpoint {found.tag} was saved with a different model/data config",
                                   f"--resume {o.resume}", "resume with the model section it was trained with")
        resume_info = {"directory": str(found.directory.resolve()), "tag": found.tag, "step": found.step,
                       "universal": found.world_size != world}
        if resume_info["universal"]:
            # ZeRO shards are cut for one world size: reshape through DeepSpeed's universal checkpoint.
            notes.append(f"{found.tag} was saved by {found.world_size} ranks and this run has {world}: "
                         "resuming through a universal checkpoint (converted once, kept under universal/)")
            resolved.ds_config.setdefault("checkpoint", {})["load_universal"] = True

    from dstrain.show import plan_lines
    for line in plan_lines(resolved.config, resolved.ds_config, world, accelerator, resolved.preset, params):
        console.print(line, soft_wrap=True)
    for note in notes:
        console.print(f"[yellow]note:[/] {note}")
    if resume_info:
        console.print(f"resume: {resume_info['tag']} (step {resume_info['step']}) from {resume_info['directory']}")
    _clear_stale_build_locks(console, o.dry_run)
    port = o.master_port or (MULTI_NODE_PORT if o.no_ssh and nodes > 1 else _free_port())
    if o.dry_run:
        console.print(f"run directory: {run_dir} (not written: --dry-run)")
        console.print("would run: " + shlex.join(_runner_command(o, ranks, nodes, Path(run_dir), port)), soft_wrap=True)
        return 0

    _prepare_run_dir(run_dir, resuming=resume_info is not None)
    if resume_info and resume_info["universal"]:
        resume_info["directory"] = str(_universal_copy(Path(resume_info["directory"]), resume_info["tag"], run_dir))
    launch_info = {"resume": resume_info, "verbose": o.verbose, "preset": resolved.preset, "world_size": world,
                   "config_hash": resolved.config_hash(), "dstrain_version": __version__, "accelerator": accelerator}
    _write_run_dir(run_dir, resolved, launch_info, own_ranks)
    if o.no_ssh and nodes > 1 and o.hostfile is None:
        _write_synthetic_hostfile(run_dir, ranks, nodes)
    console.print(f"run directory: {run_dir}")
    command = _runner_command(o, ranks, nodes, run_dir, port)
    return supervise(command, _rank_env(accelerator, max(active.values())), run_dir, o.verbose, console, own_ranks,
                     saves=resolved.config.train.save_checkpoints)


# ---------------------------------------------------------------- supervising the ranks

def _local_rank_pids(run_dir: Path, own_ranks: range | None = None) -> dict[int, int]:
    """rank -> pid of the live ranks on this machine; with own_ranks, only those (other nodes sharing
    the run directory, even on this machine, are supervised by their own `dstrain run`)."""
    pids = {}
    run_dir_arg = b"\0" + str(run_dir.resolve()).encode() + b"\0"  # a recycled pid is not our rank
    for pid_file in (run_dir / RANKS_DIR).glob("rank*.pid"):
        if own_ranks is not None and int(pid_file.name[4:-4]) not in own_ranks:
            continue
        try:
            pid = int(pid_file.read_text())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if (b"dstrain.worker" in cmdline or b"dstrain/worker.py" in cmdline) and run_dir_arg in b"\0" + cmdline:
            pids[int(pid_file.name[4:-4])] = pid
    return pids


def _stop_ranks(run_dir: Path, sig: int, own_ranks: range | None = None, skip: frozenset[int] = frozenset()) -> set[int]:
    """Send `sig` to the live ranks (but those in `skip`); returns the pids signalled."""
    pids = set(_local_rank_pids(run_dir, own_ranks).values()) - skip
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return pids


def _remove_shm_buffers(command: list[str]) -> None:
    """DeepSpeed's CPU shared-memory all-reduce leaves one /dev/shm file (~66 MB) per local rank and
    job behind, even after a clean exit; left alone they fill host RAM run after run."""
    port = command[command.index("--master_port") + 1] if "--master_port" in command else None
    if port is None:
        return
    for leftover in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
        try:
            leftover.unlink()
        except OSError:
            pass


def failure_report(run_dir: Path, alive: set[int]) -> list[str]:
    """Which ranks failed and how, from the records ranks leave under ranks/. `alive`: ranks still
    running when the launcher gave up (they were stopped because of another rank, not failed)."""
    directory = run_dir / RANKS_DIR
    started = sorted(int(p.name[4:-4]) for p in directory.glob("rank*.pid"))
    records = {r: directory / f"rank{r}.exit" for r in started}
    silent = [r for r in started if not records[r].exists() and r not in alive]
    if silent:  # no record at all: killed from outside (SIGKILL, the OOM killer) or crashed hard
        return [f"rank {r} died without reporting (killed by a signal such as SIGKILL, or out of memory)"
                for r in silent]
    texts = {r: records[r].read_text() for r in started if records[r].exists()}
    failed = sorted((records[r].stat().st_mtime_ns, r, text or "failed; its report could not be written (disk full?)")
                    for r, text in texts.items() if text != "ok")
    return [("" if i == 0 else "  then ") + f"rank {r}: {text}" for i, (_, r, text) in enumerate(failed)]


def supervise(command: list[str], env: dict[str, str], run_dir: Path, verbose: bool, console: Console,
              own_ranks: range | None = None, saves: bool = True) -> int:
    """Run the deepspeed runner, filter its chatter, forward SIGTERM/SIGINT to the ranks (which save,
    unless `saves` is false, and stop), and name the failed rank if the job fails. Returns the exit code."""
    # A new session: Ctrl-C reaches only us, and we ask the ranks to stop cleanly instead of
    # letting the launcher kill them mid-step.
    # On a terminal the ranks write to it directly (rank 0's live progress bar needs a terminal);
    # otherwise their output is piped through here and the launcher's chatter is filtered out.
    interactive = sys.stdout.isatty()
    received: list[int] = []
    deadline: list[float] = []
    signalled: set[int] = set()

    def forward(signum, _frame):
        if not received:
            console.print(f"\n{signal.Signals(signum).name}: asking the ranks to "
                          + ("save a checkpoint and stop" if saves else "stop (train.save_checkpoints is false)"))
            deadline.append(time.monotonic() + STOP_GRACE_S)
        received.append(signum)
        signalled.update(_stop_ranks(run_dir, signal.SIGTERM, own_ranks))

    # Our handlers go in first: a signal between the start of the runner and them would end us
    # and leave the job running, unsupervised.
    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        process = subprocess.Popen(command, env=env, stdout=None if interactive else subprocess.PIPE,
                                   stderr=None if interactive else subprocess.STDOUT,
                                   start_new_session=True, text=True, bufsize=1)
    except BaseException:
        for s, handler in previous.items():
            signal.signal(s, handler)
        raise

    def pump() -> None:
        if process.stdout is None:
            return
        for line in process.stdout:
            if verbose or not _RUNNER_NOISE.search(line):
                sys.stdout.write(line)
                sys.stdout.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        while process.poll() is None:
            time.sleep(0.2)
            if received:  # ranks that publish their pid after the request are asked too
                signalled.update(_stop_ranks(run_dir, signal.SIGTERM, own_ranks, frozenset(signalled)))
            if deadline and time.monotonic() > deadline[0]:
                console.print("[red]ranks did not stop in time; killing them[/]")
                break
    finally:
        alive = set(_local_rank_pids(run_dir, own_ranks))  # before any kill: these were stopped, not failed
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        _stop_ranks(run_dir, signal.SIGKILL, own_ranks)  # no orphan rank outlives the job
        _remove_shm_buffers(command)
        reader.join(timeout=5)
        for s, handler in previous.items():
            signal.signal(s, handler)
    code = process.returncode
    if code == 0 and received:
        console.print("stopped cleanly after a checkpoint; continue with --resume latest" if saves
                      else "stopped cleanly (no checkpoint: train.save_checkpoints is false)")
        return 128 + received[0]
    if code != 0:
        console.print(f"[bold red]training failed[/] (launcher exit code {code})")
        for line in failure_report(run_dir, alive):
            console.print(f"[red]{line}[/]")
        return code if code > 0 else 1
    return 0
