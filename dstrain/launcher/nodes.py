"""The nodes of a multi-node job, watched by every node's `dstrain run`: whom the job still waits for
while it assembles, and which node stopped giving signs of life once it runs.

Both come from the heartbeat files every rank writes into the shared run directory (RUN_DIR/ranks/
rank<R>.beat, dstrain/rank/heartbeat.py), whose thread rewrites them every hangs.ALIVE_EVERY_S whatever
the rank is doing. A rank is judged by when this process saw its record change, on this machine's
clock, so nodes whose clocks disagree still agree on who is silent; a record that was there before this
process started and never changes is an earlier job's.

A node's processes that die end the job in seconds: on gloo the survivors' collectives fail and
supervise.py names the rank; over NCCL the survivors wait in the collective, so this watch reads the exit
record the dead rank's own node writes (failures.record_deaths), or the rank's own report of an exception,
and ends the job FAILED_GRACE_S later, when this node's ranks have not ended on their own. It also ends
the job for the node that never comes (train.join_timeout_s, or `--join-timeout`) and the node that is
there but gives no sign of life: stopped, frozen, cut off (train.liveness_timeout_s), which would
otherwise hold every other node in a collective until the hang timeout, sized for long compiles. The
first node to reach a verdict records it in the run directory
(RUN_DIR/ranks/nodes.verdict, the silent ranks' exit records, an event in metrics.jsonl); the other nodes
read it when their own ranks fail in turn. No torch here.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.text import Text

from dstrain import rundir
from dstrain.checkpoints import LATEST
from dstrain.console_text import outside
from dstrain.hangs import DONE, Beat, read_beats
from dstrain.launcher.failures import died_line, short

CHECK_EVERY_S = 1.0
FIRST_NOTE_S = 5.0    # the first "waiting for" note: nodes started together have joined by then
NOTE_EVERY_S = 30.0   # then this often, until every node has joined
VERDICT = "nodes.verdict"  # in RUN_DIR/ranks: the report of the node that ended the job, as plain text
FAILED_GRACE_S = 5.0  # after another node's rank recorded its failure: this node's ranks may end on their own
NOT_FAILURES = ("ok", "lost", "missing")  # exit records that say no rank failed (the last two: a node verdict)


@dataclass(frozen=True)
class Node:
    index: int
    host: str
    ranks: range

    def name(self) -> str:
        """'node 1', with its host where the host is a real name (not --no-ssh's stand-in 'node1')."""
        return f"node {self.index}" + ("" if self.host == f"node{self.index}" else f" ({outside(self.host)})")


def node_layout(active: dict[str, int]) -> list[Node]:
    """The nodes of a job from topology.JobShape.active (host -> ranks, in node-rank order): global ranks are
    numbered node by node, as DeepSpeed's launcher numbers them."""
    nodes, first = [], 0
    for index, (host, count) in enumerate(active.items()):
        nodes.append(Node(index, host, range(first, first + count)))
        first += count
    return nodes


@dataclass
class Verdict:
    kind: str           # "missing" (never joined), "lost" (joined, then silent) or "failed" (a rank elsewhere
                        # recorded its death or error while this node's ranks waited on)
    nodes: list[Node]
    ranks: list[int]    # the ranks that never came, went silent, or failed
    lines: list[str]    # the report (markup, outside text escaped)


@dataclass
class _Seen:
    alive: float        # the record's `alive` when it last changed
    at: float           # this process's monotonic time when it saw that change


class NodeWatch:
    """The judgement, fed with heartbeat records and this process's monotonic time (tests feed their own)."""

    def __init__(self, run_dir: Path, nodes: list[Node], join_timeout_s: float, liveness_timeout_s: float,
                 now: float, before: dict[int, Beat] | None = None, own_ranks: range | None = None):
        self.run_dir = run_dir
        self.nodes = nodes
        self.own_ranks = own_ranks  # this process's node (--no-ssh): its ranks count, but it waits for no one else
        self.join_timeout_s = join_timeout_s
        self.liveness_timeout_s = liveness_timeout_s
        self.start = now
        self.last_check = now
        self.next_note = now + FIRST_NOTE_S
        self.waited = False  # a "waiting for" note was printed
        before = read_beats(run_dir) if before is None else before
        self.stale = {rank: beat.alive for rank, beat in before.items()}
        self.seen: dict[int, _Seen] = {}
        self.failed_at: dict[int, float] = {}  # rank elsewhere -> when this process first read its failure

    def check(self, beats: dict[int, Beat], now: float,
              failures: dict[int, str] | None = None) -> tuple[list[str], Verdict | None]:
        """(notes to print now, the verdict that ends the job or None). `failures`: the exit records of
        this job's ranks that failed (rank -> record), as NodeSupervision reads them."""
        verdict = self._failed(failures or {}, now)
        if verdict is not None:
            return [], verdict
        if now - self.last_check > max(CHECK_EVERY_S * 5, self.liveness_timeout_s / 2):
            for seen in self.seen.values():  # this process did not look for a while (suspended, starved):
                seen.at = now                # the silence it would measure is its own
        self.last_check = now
        for rank, beat in beats.items():
            seen = self.seen.get(rank)
            if seen is None:
                if self.stale.get(rank) != beat.alive:  # new since this process started: the rank has joined
                    self.seen[rank] = _Seen(beat.alive, now)
            elif beat.alive != seen.alive:
                seen.alive, seen.at = beat.alive, now
        missing = [node for node in self.nodes if any(rank not in self.seen for rank in node.ranks)]
        if missing:
            return self._assembling(missing, now)
        notes = []
        if self.waited:
            notes.append(f"all {len(self.nodes)} nodes have joined after {now - self.start:.0f} s")
            self.waited = False
        silent = [rank for rank, seen in sorted(self.seen.items())
                  if self.liveness_timeout_s > 0 and now - seen.at > self.liveness_timeout_s
                  and rank in beats and beats[rank].phase != DONE]
        if not silent:
            return notes, None
        lost = [node for node in self.nodes if any(rank in silent for rank in node.ranks)]
        return notes, Verdict("lost", lost, silent, self._lost_report(lost, silent, beats, now))

    def _failed(self, failures: dict[int, str], now: float) -> Verdict | None:
        """Another node's rank recorded its failure FAILED_GRACE_S ago, and this node's ranks still run (else
        the launcher would have ended and supervise.py reported it): over NCCL they wait for it in a
        collective until the hang timeout. This node's own ranks are its launcher's to report."""
        for rank in failures:
            if self.own_ranks is None or rank not in self.own_ranks:
                self.failed_at.setdefault(rank, now)
        ranks = sorted(r for r, at in self.failed_at.items() if now - at >= FAILED_GRACE_S)
        if not ranks:
            return None
        failed = [node for node in self.nodes if any(rank in ranks for rank in node.ranks)]
        return Verdict("failed", failed, ranks, self._failed_report(failed, ranks, failures))

    def _failed_report(self, failed: list[Node], ranks: list[int], failures: dict[int, str]) -> list[str]:
        lines = [f"[bold red]{_names(failed)} failed:[/] this node's ranks were waiting for "
                 f"{_ranks(ranks)} in a collective"]
        for rank in ranks:
            kind, _, detail = failures.get(rank, "").partition(": ")
            if kind == rundir.DIED:
                lines.append(f"  {outside(died_line(self.run_dir, rank))}")
            else:
                lines.append(f"  rank {rank} failed: {outside(short(detail or kind))}; its log: "
                             f"{outside(rundir.rank_log(self.run_dir, rank))}")
        return lines + [_ending(self.run_dir)]

    def _assembling(self, missing: list[Node], now: float) -> tuple[list[str], Verdict | None]:
        waited = now - self.start
        ranks = [rank for node in missing for rank in node.ranks if rank not in self.seen]
        if self.join_timeout_s > 0 and waited >= self.join_timeout_s:
            return [], Verdict("missing", missing, ranks, self._missing_report(missing, ranks, waited))
        others = [node for node in missing if not (self.own_ranks and set(node.ranks) <= set(self.own_ranks))]
        if now < self.next_note or not others:
            return [], None
        missing, ranks = others, [rank for node in others for rank in node.ranks if rank not in self.seen]
        self.next_note = now + NOTE_EVERY_S
        self.waited = True
        limit = (f"the job ends if they have not joined {self.join_timeout_s:.0f} s after this node started its "
                 "ranks (train.join_timeout_s, --join-timeout)" if self.join_timeout_s > 0
                 else "no limit: train.join_timeout_s is 0")
        return [f"waiting {waited:.0f} s for {_names(missing)} to join ({_ranks(ranks)} not started yet); "
                f"{limit}"], None

    def _missing_report(self, missing: list[Node], ranks: list[int], waited: float) -> list[str]:
        lines = [f"[bold red]{_names(missing)} never joined:[/] {_ranks(ranks)} had not started after {waited:.0f} s "
                 f"(train.join_timeout_s, --join-timeout)"]
        for rank in ranks:
            log = rundir.rank_log(self.run_dir, rank)
            if log.exists():
                lines.append(f"  rank {rank} started, but wrote no heartbeat; its log: {outside(log)}")
        lines.append(f"  why: in the output of {'its' if len(missing) == 1 else 'their'} `dstrain run` (was it "
                     "started, with the same --nodes, --master-addr and --run-dir?); ranks log to "
                     f"{outside(self.run_dir / rundir.RANKS)}/rank<R>.log once they start")
        return lines + [_ending(self.run_dir)]

    def _lost_report(self, lost: list[Node], silent: list[int], beats: dict[int, Beat], now: float) -> list[str]:
        quiet = max(now - self.seen[rank].at for rank in silent)
        lines = [f"[bold red]{_names(lost)} stopped answering:[/] no sign of life from {_ranks(silent)} for "
                 f"{quiet:.0f} s (limit {self.liveness_timeout_s:.0f} s, train.liveness_timeout_s)"]
        for rank in silent:
            beat = beats[rank]
            step = f" of step {beat.step}" if beat.step is not None else ""
            lines.append(f"  rank {rank} (pid {beat.pid} on {outside(beat.host)}): last sign of life at "
                         f"{time.strftime('%H:%M:%S', time.localtime(beat.alive))} (that host's clock), in phase "
                         f"{beat.phase}{step}{_process_state(beat)}; its log: "
                         f"{outside(rundir.rank_log(self.run_dir, rank))}")
        return lines + [_ending(self.run_dir)]


def _names(nodes: list[Node]) -> str:
    return ", ".join(node.name() for node in nodes)


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _process_state(beat: Beat) -> str:
    """What this machine knows of a rank that runs on it: a stopped or stuck process says why it is silent."""
    import socket
    if beat.host != socket.gethostname():
        return ""
    try:
        state = Path(f"/proc/{beat.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "; its process is gone"
    said = {"T": "is stopped (SIGSTOP?)", "t": "is stopped by a debugger", "D": "is stuck in the kernel (I/O, a driver)",
            "Z": "has ended"}
    return f"; its process {said[state]}" if state in said else ""


def _ending(run_dir: Path) -> str:
    try:
        latest = (run_dir / rundir.CHECKPOINTS / LATEST).read_text().strip()
    except OSError:
        latest = ""
    if not latest:
        return "ending the job on every node; no checkpoint was saved"
    return (f"ending the job on every node; the last complete checkpoint {outside(latest)} stays `latest`: continue "
            "on the nodes left with --resume auto (another world size resumes through a universal checkpoint)")


class NodeSupervision:
    """NodeWatch in `dstrain run`'s supervision loop: reads the records, prints, records the verdict."""

    def __init__(self, run_dir: Path, nodes: list[Node], join_timeout_s: float, liveness_timeout_s: float,
                 console: Console, own_ranks: range | None = None):
        self.run_dir = run_dir
        self.console = console
        self.watch = NodeWatch(run_dir, nodes, join_timeout_s, liveness_timeout_s, time.monotonic(),
                               own_ranks=own_ranks)
        self.verdict_before = _identity(run_dir / rundir.RANKS / VERDICT)
        self.records_before = {path.name: _identity(path) for path in (run_dir / rundir.RANKS).glob("rank*.exit")}
        self.next_check = 0.0

    def failures(self) -> dict[int, str]:
        """rank -> exit record, for the records written since this process started that say a rank failed."""
        found = {}
        for path in (self.run_dir / rundir.RANKS).glob("rank*.exit"):
            if _identity(path) in (None, self.records_before.get(path.name)):
                continue  # an earlier job's
            try:
                text = path.read_text()
            except OSError:
                continue
            if text and text.partition(":")[0] not in NOT_FAILURES:
                found[rundir.record_rank(path)] = text
        return found

    def ended(self) -> bool:
        """Check (at most every CHECK_EVERY_S); on a verdict print and record it and return True."""
        now = time.monotonic()
        if now < self.next_check:
            return False
        self.next_check = now + CHECK_EVERY_S
        notes, verdict = self.watch.check(read_beats(self.run_dir), now, self.failures())
        for note in notes:
            self.console.print(f"[yellow]note:[/] {note}", soft_wrap=True, highlight=False)
        if verdict is None:
            return False
        for line in verdict.lines:
            self.console.print(line, soft_wrap=True, highlight=False)
        record_verdict(self.run_dir, verdict, self.verdict_before)
        return True

    def verdict_elsewhere(self) -> list[str]:
        """Another node's verdict, recorded since this one started (its report lines, plain text), else []."""
        path = self.run_dir / rundir.RANKS / VERDICT
        if _identity(path) in (None, self.verdict_before):
            return []
        try:
            return path.read_text().splitlines()
        except OSError:
            return []


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_mtime_ns


def record_verdict(run_dir: Path, verdict: Verdict, before: tuple[int, int] | None) -> bool:
    """Write the verdict into the run directory, unless another node did first: RANKS/nodes.verdict (the
    report, plain text), an exit record for each silent or missing rank that has none, and a
    {"event": "node_lost" | "node_missing"} row in metrics.jsonl. Returns whether this node wrote it.
    Best effort: a full disk must not hide the report already printed."""
    directory = run_dir / rundir.RANKS
    path = directory / VERDICT
    plain = "\n".join(Text.from_markup(line).plain for line in verdict.lines) + "\n"
    tmp = directory / f".{VERDICT}.{os.getpid()}"
    try:
        tmp.write_text(plain)
        if _identity(path) not in (None, before):
            return False  # another node's verdict, written since this job started
        if before is not None:
            path.unlink(missing_ok=True)  # an earlier job's
        os.link(tmp, path)  # fails where another node got there first
    except OSError:
        return False
    finally:
        tmp.unlink(missing_ok=True)
    summary = plain.splitlines()[0]
    for rank in verdict.ranks:
        try:
            with open(rundir.exit_record(run_dir, rank), "x") as record:
                record.write(f"{verdict.kind}: {summary}")
        except OSError:
            pass  # it wrote its own
    beats = read_beats(run_dir)
    step = max((b.step for b in beats.values() if b.step is not None), default=0)
    row = {"event": f"node_{verdict.kind}", "step": step, "nodes": [n.index for n in verdict.nodes],
           "ranks": verdict.ranks, "time": time.time(), "detail": summary}
    try:
        with open(run_dir / rundir.METRICS, "a") as metrics:
            metrics.write(json.dumps(row) + "\n")
    except OSError:
        pass
    return True
