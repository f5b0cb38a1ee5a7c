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

# Rank processes a full `pytest -q` may start (both lanes): 178 on 2026-11-28 (88 launcher runs; 180 on a CPU
# that runs fp16, where the fp16 file trains), and a little room. Raise it only with a reason in the commit
# message: a run that serves several tests costs its ranks once.
RANK_BUDGET = 190

# A rank's parent: DeepSpeed's per-node launcher, or torch's elastic launcher (the benchmark suite's torch rows).
_LAUNCHERS = ("deepspeed.launcher.launch", "torch.distributed.run", "bin/torchrun")
# One-rank or few-rank processes a test starts itself (tests/one_rank.py, tests/scripts/).
_OWN_RANKS = ("init_distributed", "-m\0scripts.")
_POLL_S = 0.2  # a rank lives seconds (it imports torch), so a 0.2 s look sees every one


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def _parent_and_start(pid: str) -> tuple[str, str] | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[1], fields[19]  # ppid, start time in clock ticks (pids are reused; the pair is not)


def _descends_from(parent: str, ancestor: str) -> bool:
    """Whether a process whose parent is `parent` was started (at any depth) by `ancestor`: only this session's
    ranks count, not those of another pytest on the same machine."""
    for _ in range(32):
        if parent == ancestor:
            return True
        facts = _parent_and_start(parent)
        if facts is None or parent in ("0", "1"):
            return False
        parent = facts[0]
    return False


class LaunchCounter:
    def __init__(self):
        self.current_test = "(session start)"
        self.ranks: dict[tuple[str, str], str] = {}  # (pid, start) -> the test that was running
        self.launchers: dict[tuple[str, str], str] = {}
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
        for pid in filter(str.isdigit, os.listdir("/proc")):
            if pid == me:
                continue
            facts = _parent_and_start(pid)
            if facts is None or (pid, facts[1]) in self.ranks or (pid, facts[1]) in self.launchers:
                continue
            command = _cmdline(pid)
            if "python" not in os.path.basename(command.split("\0", 1)[0]) or not _descends_from(facts[0], me):
                continue
            key = (pid, facts[1])
            if "deepspeed.launcher.launch" in command:
                self.launchers[key] = self.current_test
            elif "scripts.build_ops" in command:  # conftest's op build joins no process group
                continue
            elif any(mark in command for mark in _OWN_RANKS) or any(
                    mark in _cmdline(facts[0]) for mark in _LAUNCHERS):
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
