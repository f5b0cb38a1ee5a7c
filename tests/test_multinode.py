"""More than one machine: every launcher flag's command line (--dry-run), the commands DeepSpeed's
own backends build from them (pdsh, OpenMPI, SLURM, with stand-ins for the cluster tools), and a real
2-node job on this machine (--no-ssh, one CPU rank per "node") that trains exactly like 1 node x 2 ranks.
"""

from __future__ import annotations

import base64
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from dstrain.cli import app
from launcher import TINY, assert_ok, dstrain, losses

EXAMPLE_HOSTFILE = Path(__file__).parent.parent / "examples" / "multinode" / "hostfile"  # worker-0/1, slots=8


def dry_run(*args: str) -> tuple[int, str, list[str]]:
    """(exit code, output, the arguments of DeepSpeed's runner, or of its per-node launcher for a job on
    this machine alone, from the 'would run' line)."""
    result = CliRunner().invoke(app, ["run", "--dry-run", "--accelerator", "cpu", "--set", "model.n_layer=1",
                                      "--set", "model.d_model=32", "--set", "data.seq_len=32", *args],
                                env={"COLUMNS": "250"})
    line = next((l for l in result.output.splitlines() if l.startswith("would run: ")), "")
    argv = shlex.split(line[len("would run: "):])
    launcher = next((a for a in argv if a in ("deepspeed.launcher.runner", "deepspeed.launcher.launch")), None)
    return result.exit_code, result.output, argv[argv.index(launcher) + 1:] if launcher else []


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def world_size(output: str) -> int:
    return int(output.split("world size ")[1].split()[0])


# ---------------------------------------------------------------------------------------
# Each flag through --dry-run: the runner command, the world size, and nothing written

def test_hostfile_runs_every_host_with_its_slots(tmp_path):
    code, output, argv = dry_run("--hostfile", str(EXAMPLE_HOSTFILE), "--run-dir", str(tmp_path / "r"))
    assert code == 0, output
    assert flag(argv, "--hostfile") == str(EXAMPLE_HOSTFILE)
    assert (flag(argv, "--num_gpus"), flag(argv, "--num_nodes")) == ("8", "2")
    assert world_size(output) == 16
    assert argv[-3:] == ["--module", "dstrain.rank.worker", str((tmp_path / "r").resolve())]
    assert not (tmp_path / "r").exists()


def test_gpus_and_nodes_narrow_the_hostfile():
    code, output, argv = dry_run("--hostfile", str(EXAMPLE_HOSTFILE), "--nodes", "1", "--gpus", "4")
    assert code == 0 and (flag(argv, "--num_gpus"), flag(argv, "--num_nodes")) == ("4", "1")
    assert world_size(output) == 4


def test_include_passes_through_and_sets_the_world_size():
    code, output, argv = dry_run("--hostfile", str(EXAMPLE_HOSTFILE), "--include", "worker-0:0,1@worker-1:0,1,2")
    assert code == 0, output
    assert flag(argv, "--include") == "worker-0:0,1@worker-1:0,1,2" and "--num_gpus" not in argv
    assert world_size(output) == 5


def test_exclude_passes_through_and_sets_the_world_size():
    code, output, argv = dry_run("--hostfile", str(EXAMPLE_HOSTFILE), "--exclude", "worker-1")
    assert code == 0 and flag(argv, "--exclude") == "worker-1" and "--num_nodes" not in argv
    assert world_size(output) == 8


def world_info(argv: list[str]) -> dict:
    encoded = next(a for a in argv if a.startswith("--world_info=")).split("=", 1)[1]
    return json.loads(base64.urlsafe_b64decode(encoded))


def test_a_job_on_this_machine_alone_starts_deepspeeds_per_node_launcher_directly(tmp_path):
    code, output, argv = dry_run("--gpus", "2", "--run-dir", str(tmp_path / "r"))
    assert code == 0, output
    assert "deepspeed.launcher.launch" in output and "deepspeed.launcher.runner" not in output
    assert world_info(argv) == {"localhost": [0, 1]}
    assert (flag(argv, "--master_addr"), argv[-3:]) == ("127.0.0.1", ["--module", "dstrain.rank.worker",
                                                                      str((tmp_path / "r").resolve())])


def test_cuda_visible_devices_picks_the_devices_of_a_local_job(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,5")
    code, output, argv = dry_run("--gpus", "2")
    assert code == 0, output
    assert world_info(argv) == {"localhost": [2, 3]}


def test_master_addr_and_port_pass_through():
    code, _, argv = dry_run("--hostfile", str(EXAMPLE_HOSTFILE), "--master-addr", "10.1.2.3", "--master-port", "29999")
    assert code == 0 and (flag(argv, "--master_addr"), flag(argv, "--master_port")) == ("10.1.2.3", "29999")


def test_pdsh_launcher_passes_through():
    code, _, argv = dry_run("--hostfile", str(EXAMPLE_HOSTFILE), "--launcher", "pdsh")
    assert code == 0 and flag(argv, "--launcher") == "pdsh" and flag(argv, "--num_nodes") == "2"


def test_openmpi_launcher_gets_no_node_or_gpu_counts_which_it_refuses():
    code, output, argv = dry_run("--hostfile", str(EXAMPLE_HOSTFILE), "--launcher", "openmpi")
    assert code == 0, output
    assert flag(argv, "--launcher") == "openmpi" and "--num_gpus" not in argv and "--num_nodes" not in argv
    assert world_size(output) == 16  # every slot of the hostfile


def test_openmpi_launcher_with_gpus_is_an_error_not_a_late_crash():
    code, output, _ = dry_run("--hostfile", str(EXAMPLE_HOSTFILE), "--launcher", "openmpi", "--gpus", "4")
    assert code == 2 and "hostfile" in output


def test_slurm_launcher_gets_the_worker_file_since_it_drops_module():
    code, _, argv = dry_run("--hostfile", str(EXAMPLE_HOSTFILE), "--launcher", "slurm")
    assert code == 0 and flag(argv, "--launcher") == "slurm"
    assert "--module" not in argv and argv[-2].endswith("dstrain/rank/worker.py") and Path(argv[-2]).is_file()


def test_no_ssh_starts_this_nodes_launcher_with_the_job_shape_and_a_shared_port(tmp_path):
    run_dir = tmp_path / "r"
    code, output, argv = dry_run("--nodes", "2", "--gpus", "1", "--no-ssh", "--node-rank", "1",
                                 "--master-addr", "10.1.2.3", "--run-dir", str(run_dir))
    assert code == 0, output
    assert "deepspeed.launcher.launch" in output and "deepspeed.launcher.runner" not in output
    assert flag(argv, "--master_addr") == "10.1.2.3" and "--node_rank=1" in argv
    assert flag(argv, "--master_port") == "29500"  # every node must pick the same port without talking
    assert world_info(argv) == {"node0": [0], "node1": [0]}
    assert world_size(output) == 2
    assert not run_dir.exists()  # --dry-run writes nothing


@pytest.mark.parametrize("node_rank, visible, devices", [("0", "0,1", [0, 1]), ("1", "2,3", [2, 3])])
def test_no_ssh_nodes_sharing_a_host_take_the_gpus_cuda_visible_devices_gives_each(monkeypatch, node_rank, visible,
                                                                                   devices):
    """Two --no-ssh "nodes" of 2 GPUs on one 4-GPU host: DeepSpeed's per-node launcher sets each rank's
    CUDA_VISIBLE_DEVICES from this node's entry of the world info, so node 1 must list 2,3, not 0,1."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    code, output, argv = dry_run("--nodes", "2", "--gpus", "2", "--no-ssh", "--node-rank", node_rank,
                                 "--master-addr", "127.0.0.1")
    assert code == 0, output
    info = world_info(argv)
    assert list(info) == ["node0", "node1"] and f"--node_rank={node_rank}" in argv
    assert info[f"node{node_rank}"] == devices
    assert sum(len(ids) for ids in info.values()) == world_size(output) == 4


def test_no_ssh_with_a_hostfile_names_its_hosts_and_include_keeps_the_chosen_slots():
    code, output, argv = dry_run("--hostfile", str(EXAMPLE_HOSTFILE), "--no-ssh", "--node-rank", "1", "--master-addr",
                                 "worker-0", "--nodes", "2", "--gpus", "4")
    assert code == 0, output
    assert world_info(argv) == {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}
    code, output, argv = dry_run("--hostfile", str(EXAMPLE_HOSTFILE), "--no-ssh", "--node-rank", "0", "--master-addr",
                                 "worker-0", "--include", "worker-0:0,1@worker-1:4,5")
    assert code == 0, output
    assert world_info(argv) == {"worker-0": [0, 1], "worker-1": [4, 5]} and world_size(output) == 4


@pytest.mark.parametrize("args, says", [
    (["--nodes", "2", "--no-ssh", "--node-rank", "0"], "--master-addr"),
    (["--nodes", "2", "--no-ssh", "--master-addr", "h"], "--node-rank"),
    (["--nodes", "2", "--no-ssh", "--node-rank", "2", "--master-addr", "h"], "not in 0..1"),
    (["--node-rank", "0"], "only used with --no-ssh"),
    (["--nodes", "2"], "needs the hosts to start"),
    (["--hostfile", str(EXAMPLE_HOSTFILE), "--include", "worker-0", "--exclude", "worker-1"], "cannot be combined"),
    (["--hostfile", str(EXAMPLE_HOSTFILE), "--include", "worker-0", "--gpus", "2"], "--gpus/--nodes"),
    (["--hostfile", str(EXAMPLE_HOSTFILE), "--include", "worker-7"], "not found in hostfile"),
    (["--hostfile", str(EXAMPLE_HOSTFILE), "--nodes", "3"], "lists 2 hosts"),
    (["--launcher", "torchrun"], "unknown launcher"),
])
def test_flag_mistakes_exit_2_before_anything_starts(args, says):
    code, output, _ = dry_run(*args)
    assert code == 2 and says in output, output


def test_a_launcher_without_a_hostfile_warns_that_it_is_not_used():
    code, output, _ = dry_run("--launcher", "pdsh", "--gpus", "2")
    assert code == 0 and "--launcher pdsh is not used" in output


# ---------------------------------------------------------------------------------------
# What DeepSpeed's backends make of the command: stand-ins for ssh, pdsh, mpirun and srun
# record their arguments, so the real runner builds the real per-node command.

FAKE_TOOL = """#!/bin/sh
echo "$(basename "$0") $*" >> "$FAKE_LOG"
[ "$(basename "$0")" = ssh ] && echo 10.0.0.1
exit 0
"""


@pytest.mark.integration
@pytest.mark.parametrize("launcher, expect", [
    ("pdsh", ["pdsh ", "-w worker-0,worker-1", "-m deepspeed.launcher.launch", "--module", "dstrain.rank.worker"]),
    ("openmpi", ["mpirun -n 16 -hostfile", "-u -m dstrain.rank.worker"]),
    ("slurm", ["srun -n 16 --nodes 2 --gpus-per-node 8", "dstrain/rank/worker.py"]),
])
def test_deepspeed_backends_build_a_runnable_rank_command(tmp_path, launcher, expect):
    tools = tmp_path / "bin"
    tools.mkdir()
    for name in ("ssh", "pdsh", "mpirun", "ompi_info", "srun", "sinfo"):
        (tools / name).write_text(FAKE_TOOL)
        (tools / name).chmod(0o755)
    log, run_dir = tmp_path / "calls.log", tmp_path / "run"
    env = {"PATH": f"{tools}{os.pathsep}{os.environ['PATH']}", "FAKE_LOG": str(log)}
    args = ["run", "--accelerator", "cpu", "--hostfile", str(EXAMPLE_HOSTFILE), "--launcher", launcher,
            "--master-addr", "worker-0", "--run-dir", str(run_dir)]
    for item in TINY:
        args += ["--set", item]
    # in this process (no fresh interpreter importing torch and DeepSpeed): the runner finds the stand-ins on PATH
    result = dstrain(*args, env=env, timeout=300)
    assert_ok(result)
    rank_command = [line for line in log.read_text().splitlines() if not line.startswith("ssh ")]
    assert len(rank_command) == 1, log.read_text()
    for part in expect:
        assert part in rank_command[0], rank_command[0]
    assert rank_command[0].endswith(str(run_dir.resolve()))


# A pdsh that runs each node's command here, as a remote shell would: with nothing of this process's
# environment but PATH and HOME, plus the exports DeepSpeed's runner writes into the command, and with
# DS_ACCELERATOR=cuda as a node's own profile might set it. A TORCH_EXTENSIONS_DIR set here goes along, as
# a node's profile would set a shared op folder (and the ops built here are found); without one the rank
# points itself at dstrain's own op cache (tests/test_op_cache.py).
RUNNING_PDSH = """#!{python}
import os, subprocess, sys
args = sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write("pdsh " + " ".join(args) + "\\n")
hosts = args[args.index("-w") + 1].split(",")
command = " ".join(args[args.index("-w") + 2:])
node_env = {{"PATH": os.environ["PATH"], "HOME": os.environ["HOME"], "DS_ACCELERATOR": "cuda"}}
if os.environ.get("TORCH_EXTENSIONS_DIR"):
    node_env["TORCH_EXTENSIONS_DIR"] = os.environ["TORCH_EXTENSIONS_DIR"]
nodes = [subprocess.Popen(["sh", "-c", command.replace("%n", str(i))], env=node_env) for i in range(len(hosts))]
sys.exit(max(node.wait() for node in nodes))
"""


@pytest.mark.integration
def test_pdsh_nodes_train_on_the_run_directorys_settings_not_their_environment(tmp_path):
    """What reaches another node through pdsh is the command line, the variables DeepSpeed's runner
    exports (PYTHON*, NCCL*, ...) and the shared run directory: no DS_ACCELERATOR, no DSTRAIN_*. Two
    "nodes" on this machine, each started with only that (and a DS_ACCELERATOR of its own that says
    cuda), train the run on the accelerator launch.json names."""
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "ssh").write_text(FAKE_TOOL)
    (tools / "pdsh").write_text(RUNNING_PDSH.format(python=sys.executable))
    for tool in tools.iterdir():
        tool.chmod(0o755)
    hostfile, log, run_dir = tmp_path / "hostfile", tmp_path / "calls.log", tmp_path / "run"
    hostfile.write_text("worker-0 slots=1\nworker-1 slots=1\n")
    env = {"PATH": f"{tools}{os.pathsep}{os.environ['PATH']}", "FAKE_LOG": str(log), "DSTRAIN_EXAMPLE_SWITCH": "0"}
    args = ["run", "--preset", "stage2", "--accelerator", "cpu", "--hostfile", str(hostfile), "--launcher", "pdsh",
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--run-dir", str(run_dir)]
    for item in (*TINY, "train.max_steps=2", "train.log_every=1", "train.eval_every=2", "train.save_every=2"):
        args += ["--set", item]
    result = dstrain(*args, env=env, timeout=600)
    assert_ok(result)
    pdsh = log.read_text().splitlines()[-1]
    exported = {part.split("=")[0] for part in pdsh.split("export ")[1:]}
    assert exported and all(name.startswith(("PYTHON", "MLFLOW", "MV2", "UCX", "NCCL")) for name in exported), pdsh
    assert "--node_rank=%n" in pdsh and pdsh.endswith(str(run_dir.resolve()))
    assert json.loads((run_dir / "launch.json").read_text())["accelerator"] == "cpu"
    assert sorted(losses(run_dir)) == [1, 2]
    records = {p.name: p.read_text() for p in (run_dir / "ranks").iterdir()}
    assert records["rank0.exit"] == records["rank1.exit"] == "ok"


# ---------------------------------------------------------------------------------------
# Real 2-node jobs on one machine (--no-ssh, one CPU rank per node, one run directory as on a shared
# filesystem), each run read by several tests: two nodes that train like one until one node's rank is
# killed, two nodes whose second node's rank is stopped (SIGSTOP) and the job resumed on one node, and a
# node that never comes. The judgement itself is tested in-process in tests/test_nodes.py.

STEPS = ("train.max_steps=6", "train.log_every=1", "train.save_every=3", "train.eval_every=3",
         "train.schedule=constant", "train.warmup_steps=1", "train.lr=3e-3")
UNTIL_A_NODE_FAILS = ("train.max_steps=100000",)  # longer than any test waits: a node's failure ends the run
KILL_BOUND_S = 20     # the survivors' collectives fail at once; the rest is a loaded CI machine's slack
LIVENESS_S = 10       # train.liveness_timeout_s of the stop run (the default, 60 s, is for users)
SAVE_EVERY = 12      # train.save_every of the stop run: steps between its checkpoints for the stop to land in
JOIN_S = 8            # --join-timeout of the run whose node 1 never comes (300 s by default)
# The runs below share nothing with the rest of this module: their tests may run on another xdist worker
# (conftest.py), each group with its own fixture.
STOPPED_GROUP = pytest.mark.xdist_group("two_nodes_stopped")
ALONE_GROUP = pytest.mark.xdist_group("node_never_joins")


def run_args(run_dir: Path, *extra: str, sets: tuple[str, ...] = ()) -> list[str]:
    """The arguments of `dstrain run` for the tiny stage2 job: STEPS, then `sets`."""
    args = ["run", "--preset", "stage2", "--accelerator", "cpu", "--run-dir", str(run_dir), *extra]
    for item in (*TINY, *STEPS, *sets):
        args += ["--set", item]
    return args


def dstrain_run(run_dir: Path, *extra: str, sets: tuple[str, ...] = (), log: Path | None = None) -> subprocess.Popen:
    """`dstrain run` of the tiny stage2 job (STEPS, then `sets`); its output to `log` when given (a run
    that goes on until stopped must not fill a pipe nobody reads)."""
    args = [sys.executable, "-m", "dstrain.cli", *run_args(run_dir, *extra, sets=sets)]
    output = open(log, "w") if log else subprocess.PIPE
    return subprocess.Popen(args, stdout=output, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "COLUMNS": "250"})


def run_here(run_dir: Path, *extra: str, sets: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """The same `dstrain run` as dstrain_run, to its end in this process (launcher.dstrain: no fresh interpreter
    importing torch and DeepSpeed), for the one-node runs nothing interrupts; stderr after stdout, as one stream."""
    done = dstrain(*run_args(run_dir, *extra, sets=sets), timeout=600, env={"COLUMNS": "250"})
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout + done.stderr, "")


def finish(process: subprocess.Popen) -> subprocess.CompletedProcess:
    out, _ = process.communicate(timeout=600)
    return subprocess.CompletedProcess(process.args, process.returncode, out, "")


def free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def node(shared: Path, rank: int, port: str, sets: tuple[str, ...] = (), log: Path | None = None,
         extra: tuple[str, ...] = ()) -> subprocess.Popen:
    return dstrain_run(shared, "--nodes", "2", "--gpus", "1", "--no-ssh", "--node-rank", str(rank),
                       "--master-addr", "127.0.0.1", "--master-port", port, *extra, sets=sets, log=log)


def wait_for(path: Path, processes: list[subprocess.Popen], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert all(p.poll() is None for p in processes), f"a node ended before {path} appeared"
        assert time.monotonic() < deadline, f"no {path} after {timeout} s"
        time.sleep(0.2)


@dataclass
class NodeRun:
    """One `dstrain run` of a several-node job: its exit code, output and seconds from the event to its end."""
    code: int
    output: str
    ended_after_s: float


def ended(processes: list[subprocess.Popen], logs: list[Path], since: float, timeout: float = 300) -> list[NodeRun]:
    ends: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    while len(ends) < len(processes) and time.monotonic() < deadline:
        for i, p in enumerate(processes):
            if i not in ends and p.poll() is not None:
                ends[i] = time.monotonic() - since
        time.sleep(0.1)
    for p in processes:  # past the deadline: the test fails on the times, with nothing left running
        if p.poll() is None:
            p.kill()
            p.wait()
    return [NodeRun(p.returncode, " ".join(log.read_text().split()), ends.get(i, float("inf")))
            for i, (p, log) in enumerate(zip(processes, logs))]


def wait_for_step(run_dir: Path, step: int, processes: list[subprocess.Popen], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if step in losses(run_dir):
                return
        except (OSError, ValueError):
            pass  # a line being written
        assert all(p.poll() is None for p in processes), f"a node ended before step {step}"
        assert time.monotonic() < deadline, f"no step {step} after {timeout} s"
        time.sleep(0.2)


def rank_pid(run_dir: Path, rank: int) -> int:
    return int((run_dir / "ranks" / f"rank{rank}.pid").read_text())


@pytest.fixture(scope="module")
def two_nodes_then_one_killed(tmp_path_factory):
    """Two nodes train past the checkpoint of step 6, then node 1's rank is killed (SIGKILL); and the same
    job on one node of two ranks, 6 steps, to compare with."""
    base = tmp_path_factory.mktemp("killed")
    shared, port = base / "two_nodes", str(free_port())
    logs = [base / "node1.txt", base / "node0.txt"]
    # Node 1 first, and node 0 only once node 1's rank is up and recorded: a node that starts
    # later must leave the records of the ranks already running elsewhere alone.
    nodes = [node(shared, 1, port, UNTIL_A_NODE_FAILS, logs[0])]
    wait_for(shared / "ranks" / "rank1.pid", nodes)
    nodes.append(node(shared, 0, port, UNTIL_A_NODE_FAILS, logs[1]))
    wait_for(shared / "checkpoints" / "step00000006" / "dstrain_complete.json", nodes)
    os.kill(rank_pid(shared, 1), signal.SIGKILL)
    node1, node0 = ended(nodes, logs, since=time.monotonic())
    single = base / "one_node"
    one_node = run_here(single, "--gpus", "2")
    return SimpleNamespace(shared=shared, node0=node0, node1=node1, single=single, one_node=one_node)


@pytest.mark.integration
def test_two_nodes_with_one_rank_each_train_exactly_like_one_node_with_two_ranks(two_nodes_then_one_killed):
    run = two_nodes_then_one_killed
    shared, single = run.shared, run.single
    assert_ok(run.one_node)
    # One job, one owner: node 1 came first and holds the run directory's lock; node 0 joins its job.
    assert "another node of this job holds the run directory" in run.node0.output
    assert (shared / "run.lock").read_text() == ""  # released at the end

    two, one = losses(shared), losses(single)
    assert sorted(one) == [1, 2, 3, 4, 5, 6] and {1, 2, 3, 4, 5, 6} <= set(two)
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-4), (step, two, one)
    assert one[6] < one[1]
    evals = [{row["step"]: row["eval_loss"] for row in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())
              if "eval_loss" in row and row["step"] <= 6} for d in (shared, single)]
    assert evals[0] == pytest.approx(evals[1], rel=1e-4) and sorted(evals[1]) == [3, 6]

    mark = json.loads((shared / "checkpoints" / "step00000006" / "dstrain_complete.json").read_text())
    assert mark["world_size"] == 2 and {"rng_rank0.pt", "rng_rank1.pt"} <= set(mark["files"])
    assert all(set(record) == {"size", "sha256"} for record in mark["files"].values())  # both nodes' files hashed
    records = {p.name for p in (shared / "ranks").iterdir()}
    assert {"rank0.pid", "rank1.pid", "rank0.log", "rank1.log"} <= records  # neither node removed the other's


@pytest.mark.integration
def test_a_node_whose_rank_is_killed_ends_the_job_on_every_node_in_seconds_naming_it(two_nodes_then_one_killed):
    run = two_nodes_then_one_killed
    for node_run in (run.node0, run.node1):
        assert node_run.code != 0 and node_run.ended_after_s < KILL_BOUND_S, node_run
        assert ("rank 1 died without reporting (killed by a signal such as SIGKILL, or out of memory); its log: "
                f"{run.shared / 'ranks' / 'rank1.log'}") in node_run.output, node_run.output[-3000:]
        assert "next: dstrain eval" not in node_run.output  # a failed job's summary is no invitation
    assert not (run.shared / "ranks" / "nodes.verdict").exists()  # the liveness watch had no part in it


@pytest.fixture(scope="module")
def two_nodes_then_one_stopped(tmp_path_factory):
    """Two nodes train on text files given as a list on the command line (brackets and slashes, as rich markup
    would misread them) until the first complete checkpoint; then node 1's rank is stopped (SIGSTOP), and once
    both nodes have ended, the job resumes on one node of one rank (--resume auto: a universal checkpoint)."""
    base = tmp_path_factory.mktemp("stopped")
    text = base / "text.txt"
    text.write_text("\n\n".join(p.read_text() for p in sorted((Path(__file__).parent.parent / "docs").glob("*.md"))))
    data = ("data.source=text", f"data.paths=[{text}]")
    shared, port = base / "run", str(free_port())
    logs = [base / "node0.txt", base / "node1.txt"]
    # A checkpoint every SAVE_EVERY steps: the stop lands between the first and the second, however late this
    # process sees the steps (CI's run of a3405f2 saw step 5 only once step 6's checkpoint of save_every=3 was
    # written, and the two nodes had computed no step past the checkpoint left).
    sets = (*UNTIL_A_NODE_FAILS, *data, f"train.liveness_timeout_s={LIVENESS_S}", f"train.save_every={SAVE_EVERY}")
    nodes = [node(shared, 0, port, sets, logs[0])]
    wait_for(shared / "ranks" / "rank0.pid", nodes)
    nodes.append(node(shared, 1, port, sets, logs[1]))  # the second node prints the lock's note (the command line)
    wait_for(shared / "checkpoints" / "latest", nodes)
    first_saved = int((shared / "checkpoints" / "latest").read_text().strip()[len("step"):])
    wait_for_step(shared, first_saved + 2, nodes)  # steps past the checkpoint, for the resume to repeat
    stopped_pid = rank_pid(shared, 1)
    os.kill(stopped_pid, signal.SIGSTOP)
    try:
        node0, node1 = ended(nodes, logs, since=time.monotonic())
    finally:
        try:
            os.kill(stopped_pid, signal.SIGKILL)  # in case its node did not
        except ProcessLookupError:
            pass
    before = losses(shared)
    records = {p.name: p.read_text() for p in (shared / "ranks").iterdir() if p.suffix in (".exit", ".verdict")}
    saved = int((shared / "checkpoints" / "latest").read_text().strip()[len("step"):])
    last = max(sorted(before)[-1], saved + 2) + 1  # the resume repeats every step the two nodes logged past `saved`
    resumed = run_here(shared, "--gpus", "1", "--resume", "auto",
                       sets=(f"train.max_steps={last}", "train.grad_accum_steps=2", *data))
    return SimpleNamespace(shared=shared, node0=node0, node1=node1, stopped_pid=stopped_pid, before=before,
                           records=records, saved=saved, last=last, resumed=resumed)


@pytest.mark.integration
@STOPPED_GROUP
def test_a_stopped_node_ends_the_job_on_every_node_after_the_liveness_timeout(two_nodes_then_one_stopped):
    run = two_nodes_then_one_stopped
    for node_run in (run.node0, run.node1):
        assert node_run.code == 1 and node_run.ended_after_s < LIVENESS_S + KILL_BOUND_S, node_run
        assert "node 1 stopped answering: no sign of life from rank 1 for" in node_run.output, node_run.output[-3000:]
        assert f"(limit {LIVENESS_S} s, train.liveness_timeout_s)" in node_run.output
        assert f"rank 1 (pid {run.stopped_pid} on " in node_run.output and "last sign of life at" in node_run.output
        assert "continue on the nodes left with --resume auto" in node_run.output
    assert "its process is stopped (SIGSTOP?)" in run.node1.output + run.node0.output  # the same host here
    assert not Path(f"/proc/{run.stopped_pid}").exists() or "Z" in Path(f"/proc/{run.stopped_pid}/stat").read_text()


@pytest.mark.integration
@STOPPED_GROUP
def test_the_run_directory_records_which_node_was_lost(two_nodes_then_one_stopped):
    records = two_nodes_then_one_stopped.records  # as the two nodes left them (the resume replaces them)
    assert records["nodes.verdict"].startswith("node 1 stopped answering: no sign of life from rank 1 for")
    assert records["rank1.exit"].startswith("lost: node 1 stopped answering")
    rows = [json.loads(line) for line in (two_nodes_then_one_stopped.shared / "metrics.jsonl").read_text().splitlines()]
    lost = [row for row in rows if row.get("event") == "node_lost"]
    assert len(lost) == 1 and lost[0]["nodes"] == [1] and lost[0]["ranks"] == [1]  # one node wrote it, not both


@pytest.mark.integration
@STOPPED_GROUP
def test_user_brackets_on_the_command_line_are_printed_as_written_on_the_second_node(two_nodes_then_one_stopped):
    """The second node quotes the first node's command line (the lock's note): '[/...]' is no markup."""
    run = two_nodes_then_one_stopped
    assert "another node of this job holds the run directory" in run.node1.output
    assert "data.paths=[" + str(run.shared.parent / "text.txt") + "]" in run.node1.output


@pytest.mark.integration
@STOPPED_GROUP
def test_the_job_resumes_on_the_node_left_from_the_last_complete_checkpoint(two_nodes_then_one_stopped):
    run = two_nodes_then_one_stopped
    assert_ok(run.resumed)
    assert "universal checkpoint" in run.resumed.stdout
    assert f"resumed from step{run.saved:08d} at step {run.saved}" in run.resumed.stdout
    after = losses(run.shared)
    assert sorted(after)[-1] == run.last
    repeated = sorted(step for step in set(run.before) & set(after) if step > run.saved)
    assert repeated, (run.saved, run.before)  # the two nodes went on past the checkpoint (else: raise SAVE_EVERY)
    for step in repeated:  # computed by two nodes before the stop, again by one rank (accum 2) after the resume
        assert after[step] == pytest.approx(run.before[step], rel=1e-4), (step, after, run.before)


@pytest.fixture(scope="module")
def node_that_never_comes(tmp_path_factory):
    """Node 0 of a two-node job, started alone with --join-timeout JOIN_S."""
    shared = tmp_path_factory.mktemp("alone") / "run"
    log = shared.parent / "node0.txt"
    started = time.monotonic()
    process = node(shared, 0, str(free_port()), log=log, extra=("--join-timeout", str(JOIN_S)))
    (node0,) = ended([process], [log], since=started)
    return SimpleNamespace(shared=shared, node0=node0)


@pytest.mark.integration
@ALONE_GROUP
def test_a_node_that_never_joins_is_waited_for_aloud_then_ends_the_job_naming_it(node_that_never_comes):
    run = node_that_never_comes
    assert run.node0.code == 1 and run.node0.ended_after_s < 120, run.node0  # start-up, then JOIN_S
    assert "note: waiting 5 s for node 1 to join (rank 1 not started yet); the job ends if they have not joined " \
           f"{JOIN_S} s after this node started its ranks" in run.node0.output, run.node0.output[-3000:]
    assert f"node 1 never joined: rank 1 had not started after {JOIN_S} s (train.join_timeout_s, --join-timeout)" \
        in run.node0.output
    assert f"ranks log to {run.shared / 'ranks'}/rank<R>.log once they start" in run.node0.output
    assert "ending the job on every node; no checkpoint was saved" in run.node0.output
    assert "training failed" not in run.node0.output  # one message, not a second one for the killed rank


@pytest.mark.integration
@ALONE_GROUP
def test_join_timeout_is_frozen_with_the_runs_config_and_the_verdict_recorded(node_that_never_comes):
    shared = node_that_never_comes.shared
    assert f"join_timeout_s: {float(JOIN_S)}" in (shared / "config.yaml").read_text()
    assert (shared / "ranks" / "nodes.verdict").read_text().startswith("node 1 never joined")
    assert (shared / "ranks" / "rank1.exit").read_text().startswith("missing: node 1 never joined")
    assert not any(p.name.startswith("rank0.exit") for p in (shared / "ranks").iterdir())  # rank 0 was killed
