"""The launch guard: counts the rank processes the test session starts and fails the session past
RANK_BUDGET, naming the tests that started them. Rank start-ups are most of CI's time (each imports torch
and DeepSpeed and joins a process group), so a new feature's launcher tests read an existing run or replace
one instead of adding their own. Counted from /proc, not from the helpers: every way a test starts a rank
counts, whichever helper or subprocess call it goes through. It counts processes, never seconds, so a slow
day cannot fail it."""

from __future__ import annotations

import os
import threading
from collections import Counter
from pathlib import Path

# Rank processes a full `pytest -q` may start: 167 in CI's run of 2026-11-29 01:23 UTC (84 launcher runs; 169 on
# a CPU that runs fp16, where the fp16 file trains; 178 on 2026-11-28 before runs were shared further), and a
# little room. Raise it only with a reason in the commit message: a run that serves several tests costs its
# ranks once.
RANK_BUDGET = 175

# A rank's parent: DeepSpeed's per-node launcher, or torch's elastic launcher (the benchmark suite's torch rows).
_LAUNCHERS = ("deepspeed.launcher.launch", "torch.distributed.run", "bin/torchrun")
# One-rank or few-rank processes a test starts itself (tests/one_rank.py, tests/scripts/).
_OWN_RANKS = ("init_distributed", "-m\0scripts.")
# A rank lives seconds (it imports torch first), so a look every second sees every one. Each look reads
# every process's stat once (about 1 ms for 100 processes): at 0.2 s, with a file read per ancestor, the three
# workers of a CI run spent minutes of CPU watching.
_POLL_S = 1.0


def _read(path: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return b""
    try:
        return os.read(fd, 65536)
    except OSError:
        return b""
    finally:
        os.close(fd)


def _cmdline(pid: str) -> str:
    return _read(f"/proc/{pid}/cmdline").decode(errors="replace")


def _parent_and_start(pid: str) -> tuple[str, str] | None:
    fields = _read(f"/proc/{pid}/stat").rsplit(b")", 1)[-1].split()
    if len(fields) < 20:
        return None
    return fields[1].decode(), fields[19].decode()  # ppid, start time in clock ticks (pids are reused; the pair is not)


def _descends_from(parent: str, ancestor: str, processes: dict[str, tuple[str, str]]) -> bool:
    """Whether a process whose parent is `parent` was started (at any depth) by `ancestor`: only this session's
    ranks count, not those of another pytest on the same machine. `processes`: pid -> (ppid, start), one look's."""
    for _ in range(32):
        if parent == ancestor:
            return True
        facts = processes.get(parent)
        if facts is None or parent in ("0", "1"):
            return False
        parent = facts[0]
    return False


# In the command line of the processes tests/test_launch_count.py starts: counted by that test's own counter,
# never by the session's.
SELF_TEST_MARK = "launch-count-self-test"


class LaunchCounter:
    def __init__(self, self_test: bool = False):
        self.self_test = self_test
        self.current_test = "(session start)"
        self.ranks: dict[tuple[str, str], str] = {}  # (pid, start) -> the test that was running
        self.launchers: dict[tuple[str, str], str] = {}
        self._elsewhere: set[tuple[str, str]] = set()  # processes that are not this session's descendants
        self._added: list[dict] = []  # the workers' counts, in an xdist controller
        self._counting = Path("/proc/self/stat").exists()  # Linux; elsewhere nothing is counted, and the report says so
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="launch-counter", daemon=True)

    def start(self) -> None:
        if self._counting:
            self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join()
            self._look()  # a last look

    def _watch(self) -> None:
        while not self._stop.wait(_POLL_S):
            self._look()

    def _look(self) -> None:
        me = str(os.getpid())
        processes = {pid: facts for pid in filter(str.isdigit, os.listdir("/proc"))
                     if (facts := _parent_and_start(pid)) is not None}
        for pid, (parent, start) in processes.items():
            key = (pid, start)
            if pid == me or key in self.ranks or key in self.launchers or key in self._elsewhere:
                continue
            if not _descends_from(parent, me, processes):
                self._elsewhere.add(key)  # a process another one started: never this session's (its parent stays)
                continue
            command = _cmdline(pid)
            if "python" not in os.path.basename(command.split("\0", 1)[0]) or (SELF_TEST_MARK in command) != self.self_test:
                continue
            if "deepspeed.launcher.launch" in command:
                self.launchers[key] = self.current_test
            elif "scripts.build_ops" in command:  # conftest's op build joins no process group
                continue
            elif any(mark in command for mark in _OWN_RANKS) or any(
                    mark in _cmdline(parent) for mark in _LAUNCHERS):
                self.ranks[key] = self.current_test

    def counts(self) -> dict:
        """What an xdist worker sends the controller: the test behind each rank, and the launcher runs."""
        return {"ranks": list(self.ranks.values()), "launchers": len(self.launchers), "counted": self._counting}

    def add(self, counts: dict) -> None:
        """Add a worker's counts(), in the controller."""
        for i, test in enumerate(counts.get("ranks", [])):
            self.ranks[(f"worker{len(self._added)}", str(i))] = test
        for i in range(counts.get("launchers", 0)):
            self.launchers[(f"worker{len(self._added)}", str(i))] = ""
        self._added.append(counts)

    def over_budget(self) -> bool:
        return len(self.ranks) > RANK_BUDGET

    def report(self) -> list[str]:
        if not self._counting:
            return ["rank processes: not counted on this OS (the guard reads /proc)"]
        lines = [f"rank processes started: {len(self.ranks)} (budget {RANK_BUDGET}, tests/launch_count.py), "
                 f"by {len(self.launchers)} DeepSpeed launcher runs"]
        if self.over_budget():
            by_test = Counter(self.ranks.values())
            lines.append(f"FAILED: {len(self.ranks)} rank processes is past the budget of {RANK_BUDGET}. Make the "
                         "new tests read an existing run (a module or session fixture) or test the logic in-process. "
                         "The tests that start ranks, most first:")
            lines += [f"  {count:4d}  {test}" for test, count in by_test.most_common()]
        return lines
