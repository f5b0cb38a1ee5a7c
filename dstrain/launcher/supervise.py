"""Supervising the ranks: run the deepspeed runner, filter its chatter, forward SIGTERM/SIGINT (the same
signal) so the ranks save and stop, end a hung job (watchdog.py), kill what outlives the job, and name
the rank that failed.

It reads the ranks' pid and exit records under RUN_DIR/ranks/ (written by dstrain/rank/worker.py);
it never imports torch or DeepSpeed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from rich.console import Console

from dstrain.console_text import outside
from dstrain.launcher.failures import failure_report, record_deaths, wait_for_records
from dstrain.launcher.nodes import Node, NodeSupervision
from dstrain.launcher.watchdog import Watchdog
from dstrain.rundir import GAVE_UP, RANKS


HUNG_EXIT = 1
NODE_EXIT = 1     # a node never joined, or stopped answering (nodes.py)
GAVE_UP_EXIT = 1  # the run health guard gave up (dstrain/rank/health.py)
STOP_GRACE_S = 110  # a preempted job must be gone within 120 s; ranks get this long to save
OTHER_RECORDS_WAIT_S = 3.0  # for the other nodes' exit records, before naming the rank that failed


# The launcher's own lines; its "[ERROR] [...] exits with return code" repeats what dstrain's failure message says.
_RUNNER_NOISE = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,]+\] \[(INFO|DEBUG)\]|Setting accelerator to CPU|"
                           r"Unable to find hostfile|get learning rate from scheduler before it has started|"
                           r"\[ERROR\] \[launch\.py:\d+:\w+\] .* exits with return code = ")


def live_rank_pids(run_dir: Path, own_ranks: range | None = None) -> dict[int, int]:
    """rank -> pid of the live ranks on this machine; with own_ranks, only those (other nodes sharing
    the run directory, even on this machine, are supervised by their own `dstrain run`)."""
    pids = {}
    run_dir_arg = b"\0" + str(run_dir.resolve()).encode() + b"\0"  # a recycled pid is not our rank
    for pid_file in (run_dir / RANKS).glob("rank*.pid"):
        if own_ranks is not None and int(pid_file.name[4:-4]) not in own_ranks:
            continue
        try:
            pid = int(pid_file.read_text())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if (b"dstrain.rank.worker" in cmdline or b"dstrain/rank/worker.py" in cmdline) and run_dir_arg in b"\0" + cmdline:
            pids[int(pid_file.name[4:-4])] = pid
    return pids


def _stop_ranks(run_dir: Path, sig: int, own_ranks: range | None = None, skip: frozenset[int] = frozenset()) -> set[int]:
    """Send `sig` to the live ranks (but those in `skip`); returns the pids signalled."""
    pids = set(live_rank_pids(run_dir, own_ranks).values()) - skip
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return pids


def _remove_shm_buffers(command: list[str]) -> None:
    """DeepSpeed's CPU shared-memory all-reduce leaves one /dev/shm file (~66 MB) per local rank and
    job behind, even after a clean exit; left alone they fill host RAM run after run."""
    if "--master_port" in command:
        remove_allreduce_buffers(command[command.index("--master_port") + 1])


def remove_allreduce_buffers(port: int | str) -> None:
    """Remove this user's DeepSpeed CPU all-reduce buffers of jobs on `port`
    (/dev/shm/deepspeed_allreduce_buffer_<uid>_<address>_<port>_<rank>). Before a job too: a rank maps
    the other ranks' buffers by name as soon as they exist, so one left by an earlier job on the same
    port would be read, with that job's handshake flags, before its new owner writes it."""
    for leftover in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"):
        try:
            leftover.unlink()
        except OSError:
            pass


def start_launcher(command: list[str], env: dict[str, str]) -> subprocess.Popen:
    """Start the deepspeed launcher in a new session: Ctrl-C reaches only us, and we ask the ranks to
    stop cleanly instead of letting the launcher kill them mid-step. On a terminal the ranks write to
    it directly (rank 0's live progress bar needs a terminal); otherwise their output is piped through
    here (supervise's reader) and the launcher's chatter is filtered out."""
    interactive = sys.stdout.isatty()
    _remove_shm_buffers(command)  # an earlier job's, on the port this one takes
    return subprocess.Popen(command, env=env, stdout=None if interactive else subprocess.PIPE,
                            stderr=None if interactive else subprocess.STDOUT,
                            start_new_session=True, text=True, bufsize=1)


def supervise(command: list[str], env: dict[str, str], run_dir: Path, verbose: bool, console: Console,
              own_ranks: range | None = None, saves: bool = True, hang_timeout_s: float = 0,
              started: subprocess.Popen | None = None, nodes: list[Node] | None = None,
              join_timeout_s: float = 0, liveness_timeout_s: float = 0) -> int:
    """Run the deepspeed runner (or take over `started`, the launcher early_start.py began), filter
    its chatter, forward SIGTERM/SIGINT to the ranks (which save, unless `saves` is false, and stop),
    end the job if its ranks hang (watchdog.py; `hang_timeout_s`, 0: never), or, with several `nodes`,
    if one never joins or stops answering (nodes.py), and name the failed rank if the job fails.
    Returns the exit code."""
    received: list[int] = []
    deadline: list[float] = []
    signalled: set[int] = set()

    def forward(signum, _frame):
        if not received:
            console.print(f"\n{signal.Signals(signum).name}: asking the ranks to "
                          + ("save a checkpoint and stop" if saves else "stop (train.save_checkpoints is false)"))
            deadline.append(time.monotonic() + STOP_GRACE_S)
        received.append(signum)
        # The same signal, so the ranks (and their "stopped by ..." line) name the one that arrived.
        signalled.update(_stop_ranks(run_dir, received[0], own_ranks))

    # Our handlers go in first: a signal between the start of the runner and them would end us
    # and leave the job running, unsupervised.
    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        process = started if started is not None else start_launcher(command, env)
    except BaseException:
        for s, handler in previous.items():
            signal.signal(s, handler)
        raise

    reader = threading.Thread(target=_pump, args=(process, verbose), daemon=True)
    reader.start()
    watchdog = Watchdog(run_dir, hang_timeout_s, console)
    node_watch = (NodeSupervision(run_dir, nodes, join_timeout_s, liveness_timeout_s, console, own_ranks)
                  if nodes and len(nodes) > 1 else None)
    hung = node_verdict = False
    try:
        while process.poll() is None:
            time.sleep(0.2)
            if watchdog.hung(lambda: live_rank_pids(run_dir, own_ranks)):
                hung = True
                break
            if node_watch is not None and not received and node_watch.ended():
                node_verdict = True
                break
            if received:  # ranks that publish their pid after the request are asked too
                signalled.update(_stop_ranks(run_dir, received[0], own_ranks, frozenset(signalled)))
            if deadline and time.monotonic() > deadline[0]:
                console.print("[red]ranks did not stop in time; killing them[/]")
                break
    finally:
        alive = set(live_rank_pids(run_dir, own_ranks))  # before any kill: these were stopped, not failed
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        _stop_ranks(run_dir, signal.SIGKILL, own_ranks)  # no orphan rank outlives the job
        _remove_shm_buffers(command)
        reader.join(timeout=5)
        for s, handler in previous.items():
            signal.signal(s, handler)
    if hung:
        return HUNG_EXIT
    if node_verdict:
        return NODE_EXIT
    elsewhere = node_watch.verdict_elsewhere() if node_watch is not None and process.returncode != 0 else []
    if elsewhere:  # this node's ranks failed because another node ended the job: say why, once
        console.print("[bold red]training failed:[/] another node's `dstrain run` ended the job:")
        for line in elsewhere:
            console.print(f"  {outside(line)}", soft_wrap=True)
        return NODE_EXIT
    return _job_exit_code(process.returncode, received[0] if received else None, saves, run_dir, alive, console,
                          own_ranks)


def _pump(process: subprocess.Popen, verbose: bool) -> None:
    """Copy the ranks' piped output to ours, without the launcher's chatter unless verbose."""
    if process.stdout is None:
        return
    for line in process.stdout:
        if verbose or not _RUNNER_NOISE.search(line):
            sys.stdout.write(line)
            sys.stdout.flush()


def _job_exit_code(code: int, signum: int | None, saves: bool, run_dir: Path, alive: set[int],
                   console: Console, own_ranks: range | None = None) -> int:
    """dstrain run's exit code from the launcher's, saying how the job ended: 128 + the signal after a
    clean stop, the launcher's code (at least 1) with the failed ranks named after a failure."""
    if code == 0 and signum is not None:
        console.print("stopped cleanly after a checkpoint; continue with --resume latest" if saves
                      else "stopped cleanly (no checkpoint: train.save_checkpoints is false)")
        return 128 + signum
    if code != 0 and every_rank_gave_up(run_dir):
        # The guard's report is printed; a rank that then died in teardown must not turn "gave up"
        # (exit 1, documented) into the launcher's code for a crash.
        console.print("[bold red]training gave up[/] (run health; report above)")
        return GAVE_UP_EXIT
    if code != 0:
        if own_ranks is not None:  # other nodes share the job: tell them first, then hear from them
            record_deaths(run_dir, alive, own_ranks)
            wait_for_records(run_dir, own_ranks, OTHER_RECORDS_WAIT_S)
        console.print(f"[bold red]training failed[/] (launcher exit code {code})")
        for line in failure_report(run_dir, alive, own_ranks):  # the rank's exception and the run directory's path
            console.print(f"[red]{outside(line)}[/]")
        return code if code > 0 else 1
    return 0


def every_rank_gave_up(run_dir: Path) -> bool:
    """Whether every rank that started recorded the run health guard's give-up as its exit."""
    directory = run_dir / RANKS
    started = [p.with_suffix(".exit") for p in directory.glob("rank*.pid")]
    try:
        return bool(started) and all(p.read_text().startswith(GAVE_UP) for p in started)
    except OSError:
        return False
