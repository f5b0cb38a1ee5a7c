"""More than one machine: every launcher flag's command line (--dry-run), the commands DeepSpeed's
own backends build from them (pdsh, OpenMPI, SLURM, with stand-ins for the cluster tools), and a real
2-node job on this machine (--no-ssh, one CPU rank per "node") that trains exactly like 1 node x 2 ranks.
"""

from __future__ import annotations

import base64
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dstrain.cli import app
from launcher import TINY, assert_ok, losses

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
    env = {**os.environ, "PATH": f"{tools}{os.pathsep}{os.environ['PATH']}", "FAKE_LOG": str(log)}
    args = ["run", "--accelerator", "cpu", "--hostfile", str(EXAMPLE_HOSTFILE), "--launcher", launcher,
            "--master-addr", "worker-0", "--run-dir", str(run_dir)]
    for item in TINY:
        args += ["--set", item]
    result = subprocess.run([sys.executable, "-m", "dstrain.cli", *args], env=env, capture_output=True, text=True,
                            timeout=300)
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
    env = {**os.environ, "PATH": f"{tools}{os.pathsep}{os.environ['PATH']}", "FAKE_LOG": str(log),
           "DSTRAIN_EXAMPLE_SWITCH": "0"}
    args = ["run", "--preset", "stage2", "--accelerator", "cpu", "--hostfile", str(hostfile), "--launcher", "pdsh",
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--run-dir", str(run_dir)]
    for item in (*TINY, "train.max_steps=2", "train.log_every=1", "train.eval_every=2", "train.save_every=2"):
        args += ["--set", item]
    result = subprocess.run([sys.executable, "-m", "dstrain.cli", *args], env=env, capture_output=True, text=True,
                            timeout=600)
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
# A real 2-node job on one machine

STEPS = ("train.max_steps=6", "train.log_every=1", "train.save_every=3", "train.eval_every=3",
         "train.schedule=constant", "train.warmup_steps=1", "train.lr=3e-3")


def dstrain_run(run_dir: Path, *extra: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "dstrain.cli", "run", "--preset", "stage2", "--accelerator", "cpu",
            "--run-dir", str(run_dir), *extra]
    for item in (*TINY, *STEPS):
        args += ["--set", item]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "COLUMNS": "250"})


def finish(process: subprocess.Popen) -> subprocess.CompletedProcess:
    out, _ = process.communicate(timeout=600)
    return subprocess.CompletedProcess(process.args, process.returncode, out, "")


def free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.integration
@pytest.mark.oldest_deepspeed
def test_two_nodes_with_one_rank_each_train_exactly_like_one_node_with_two_ranks(tmp_path):
    shared = tmp_path / "two_nodes"  # one run directory, as on a shared filesystem
    port = str(free_port())

    def node(rank: int) -> subprocess.Popen:
        return dstrain_run(shared, "--nodes", "2", "--gpus", "1", "--no-ssh", "--node-rank", str(rank),
                           "--master-addr", "127.0.0.1", "--master-port", port)

    # Node 1 first, and node 0 only once node 1's rank is up and recorded: a node that starts
    # later must leave the records of the ranks already running elsewhere alone.
    nodes = [node(1)]
    deadline = time.monotonic() + 300
    while not (shared / "ranks" / "rank1.pid").exists() and nodes[0].poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    nodes.append(node(0))
    single = tmp_path / "one_node"
    node1, node0 = [finish(node) for node in nodes]
    for result in (node1, node0):
        assert_ok(result)
    assert_ok(finish(dstrain_run(single, "--gpus", "2")))
    # One job, one owner: node 1 came first and holds the run directory's lock; node 0 joins its job.
    assert "another node of this job holds the run directory" in " ".join(node0.stdout.split())
    assert (shared / "run.lock").read_text() == ""  # released at the end

    two, one = losses(shared), losses(single)
    assert sorted(two) == sorted(one) == [1, 2, 3, 4, 5, 6]
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-4), (step, two, one)
    assert one[6] < one[1]
    evals = [{row["step"]: row["eval_loss"] for row in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())
              if "eval_loss" in row} for d in (shared, single)]
    assert evals[0] == pytest.approx(evals[1], rel=1e-4)

    mark = json.loads((shared / "checkpoints" / "step00000006" / "dstrain_complete.json").read_text())
    assert mark["world_size"] == 2 and {"rng_rank0.pt", "rng_rank1.pt"} <= set(mark["files"])
    assert all(set(record) == {"size", "sha256"} for record in mark["files"].values())  # both nodes' files hashed
    records = {p.name: p.read_text() for p in (shared / "ranks").iterdir()}
    assert records["rank0.exit"] == records["rank1.exit"] == "ok"  # neither node removed the other's records
    assert {"rank0.pid", "rank1.pid"} <= set(records)
