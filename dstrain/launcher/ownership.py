"""Who owns a run directory: one job at a time, for the job's whole life.

The supervising `dstrain run` (or `dstrain eval`, on its own eval/ folder) holds an exclusive
`fcntl.flock` on RUN_DIR/run.lock and writes its host, pid, command, start time and job id inside.
A second writer finds the lock held and is refused (exit 2) naming the holder, before it writes
anything. The kernel drops a flock when its holder dies, so a lock file whose holder is gone is
taken over at once (unless ranks it started still run there); the content it still holds (the dead
holder's) only feeds a one-line note.

The nodes of one multi-node job started separately (`--no-ssh`, once per node) share the run
directory: they carry the same job id, and a node that finds the lock held by its own job joins
instead of being refused (the first node to arrive holds the lock for the job).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shlex
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dstrain.config.resolve import REDACTED, SECRET_KEY
from dstrain.errors import UserError
from dstrain.launcher.supervise import live_rank_pids
from dstrain.rundir import LOCK

_READ_RETRIES = 20  # a holder writes its details right after taking the lock: give it a moment


@dataclass
class Holder:
    """What a lock file says about the process holding it."""

    host: str
    pid: int
    command: str
    started: float
    job: str | None = None

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(self.started))
        return f"pid {self.pid} on host {self.host}, started {when}: {self.command}"

    @classmethod
    def parse(cls, text: str) -> "Holder | None":
        try:
            data = json.loads(text)
            return cls(str(data["host"]), int(data["pid"]), str(data["command"]), float(data["started"]),
                       data.get("job"))
        except (ValueError, KeyError, TypeError):
            return None


@dataclass
class RunDirLock:
    """A held lock (or, for a node joining its own job, none held: `handle` is None)."""

    path: Path
    handle: object | None
    note: str | None = None  # a line for the user: a stale lock taken over, or a job joined

    def release(self) -> None:
        """Empty the file, then unlock: a later job finds no holder details, hence no stale-lock note."""
        if self.handle is None:
            return
        try:
            self.handle.truncate(0)
            self.handle.flush()
        except OSError:
            pass
        fcntl.flock(self.handle.fileno(), fcntl.LOCK_UN)
        self.handle.close()
        self.handle = None


def multi_node_job_id(master_addr: str | None, port: int, nodes: int) -> str:
    """The id every node of one `--no-ssh` job computes alike: the rendezvous it shares (and SLURM's
    job id, when srun started the nodes)."""
    slurm = os.environ.get("SLURM_JOB_ID")
    return f"{master_addr}:{port}/{nodes} nodes" + (f"/slurm {slurm}" if slurm else "")


def acquire(run_dir: Path, what: str, job: str | None = None) -> RunDirLock:
    """Take RUN_DIR's lock for this process, or raise UserError naming the holder.

    `what` names the option that chose the directory (for the message), `job` is the multi-node
    job id (None: a job of one process, which never shares)."""
    path = run_dir / LOCK
    handle = open(path, "a+")  # never truncates: the holder's details stay readable until we hold it
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_holder(handle)
        handle.close()
        if job is not None and holder is not None and holder.job == job:
            return RunDirLock(path, None, f"another node of this job holds the run directory ({holder.describe()})")
        raise UserError.single(
            "this run directory belongs to a job that is still running: "
            + (holder.describe() if holder else f"its holder has not written {path} yet"),
            what, "wait for that job to end or stop it (kill -TERM <pid> on its host), or choose another "
                  "--run-dir; `dstrain eval --run-dir` can read it while it runs")
    except OSError as err:
        if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
        handle.close()  # a filesystem without locks (some NFS mounts): run, but say it is unguarded
        return RunDirLock(path, None, f"{path.parent} cannot be locked ({err.strerror}): nothing stops a "
                                      "second job from writing there")
    orphans = live_rank_pids(run_dir)
    if orphans:  # their `dstrain run` was killed (SIGKILL) and they write on: the directory is not free
        handle.close()
        pids = " ".join(str(pid) for pid in sorted(orphans.values()))
        raise UserError.single(f"ranks of an earlier job still run in this run directory (pids {pids}), though "
                               "the `dstrain run` that started them is gone", what,
                               f"stop them (kill {pids}) and start again, or choose another --run-dir")
    previous = Holder.parse(_read_all(handle))
    _write_holder(handle, job)
    note = None
    if previous is not None and not (previous.host == socket.gethostname() and previous.pid == os.getpid()):
        note = f"took over the run directory from a job that is gone ({previous.describe()})"
    return RunDirLock(path, handle, note)


def current_holder(run_dir: Path) -> Holder | None:
    """The live holder of RUN_DIR's lock, if any, without taking it or creating anything (--dry-run)."""
    try:
        handle = open(run_dir / LOCK)
    except OSError:
        return None
    with handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_holder(handle)
        except OSError:
            return None
        fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
        return None


def _read_all(handle) -> str:
    handle.seek(0)
    return handle.read()


def _read_holder(handle) -> Holder | None:
    for _ in range(_READ_RETRIES):
        holder = Holder.parse(_read_all(handle))
        if holder is not None:
            return holder
        time.sleep(0.05)
    return None


def _write_holder(handle, job: str | None) -> None:
    details = {"host": socket.gethostname(), "pid": os.getpid(), "command": shlex.join(_command()),
               "started": time.time(), "job": job}
    handle.seek(0)
    handle.truncate(0)
    handle.write(json.dumps(details) + "\n")
    handle.flush()
    os.fsync(handle.fileno())


def _command() -> list[str]:
    """The command line, as the user typed it (`dstrain ...`), with secret --set values redacted: the
    lock file is as readable as the run's other files."""
    return ["dstrain", *(_redact_setting(arg) for arg in sys.argv[1:])]


def _redact_setting(arg: str) -> str:
    key, sep, _ = arg.partition("=")
    return f"{key}={REDACTED}" if sep and SECRET_KEY.search(key.rsplit(".", 1)[-1]) else arg
