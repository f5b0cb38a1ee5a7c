"""A failed run as one message: the rank that failed first, its exception in a line or two, the config key
responsible where dstrain can tell, and that rank's full log (RUN_DIR/ranks/rank<R>.log).

Read from the records ranks leave under RUN_DIR/ranks/ (dstrain/rank/worker.py); imports neither torch
nor DeepSpeed.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from dstrain import rundir

# An exception's text -> (the config key behind it, the fix). Each is a failure seen in a rank, not a guess
# at one: what pre-flight cannot know before the ranks start (memory, the disk, a build).
CONFIG_KEYS = (
    (re.compile(r"OutOfMemoryError|out of memory|CUDA error: out of memory", re.I),
     "train.micro_batch_size", "lower it (train.grad_accum_steps keeps the batch), or pick a preset that saves "
                               "memory: `dstrain estimate` compares them; with a large vocabulary, "
                               "train.loss_chunking=true never holds the whole logits"),
    (re.compile(r"Not enough buffers \d+ for swapping"),
     "deepspeed.zero_optimization.stage3_max_reuse_distance", "set it to 0 with parameters on NVMe"),
    (re.compile(r"nvme|libaio|async_io|aio_handle", re.I),
     "deepspeed.zero_optimization.offload_param.nvme_path / offload_optimizer.nvme_path",
     "a writable local NVMe folder; `dstrain doctor --nvme-path PATH` checks one"),
    (re.compile(r"Type fp16 is not supported"), "train.precision", "bf16 or fp32 on CPU ranks"),
    (re.compile(r"Type bf16 is not supported"), "train.precision", "fp16 or fp32 on this device"),
    (re.compile(r"is not a supported DeepSpeed Optimizer"), "deepspeed.optimizer.type / train.optimizer",
     "AdamW, Adam or Lamb"),
    (re.compile(r"QuantizerBuilder|quantizer", re.I), "deepspeed.zero_optimization.zero_quantized_*",
     "remove ZeRO++ quantization (it needs CUDA)"),
    (re.compile(r"deepcompile|DeepCompile"), "deepspeed.compile.deepcompile", "remove it to run eager"),
    (re.compile(r"non-finite loss|loss is (nan|inf)", re.I), "train.lr", "a lower learning rate, or train.grad_clip"),
)


def short(text: str, limit: int = 240) -> str:
    """An exception in one or two lines: its last line of substance, whitespace collapsed, cut at `limit`."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return "failed; its report could not be written (disk full?)"
    head = " ".join(lines[:2]) if len(lines) > 1 and len(lines[0]) < 100 else lines[0]
    head = " ".join(head.split())
    return head if len(head) <= limit else head[: limit - 3] + "..."


def config_key(text: str) -> tuple[str, str] | None:
    """(key path, fix) behind an exception's text, where dstrain can tell."""
    for pattern, key, fix in CONFIG_KEYS:
        if pattern.search(text):
            return key, fix
    return None


DIED_WHY = "killed by a signal such as SIGKILL, or out of memory"


def died_line(run_dir: Path, rank: int) -> str:
    return f"rank {rank} died without reporting ({DIED_WHY}); its log: {rundir.rank_log(run_dir, rank)}"


def _started(run_dir: Path) -> list[int]:
    return sorted(int(p.name[4:-4]) for p in (run_dir / rundir.RANKS).glob("rank*.pid"))


def _record_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def record_deaths(run_dir: Path, alive: set[int], own_ranks: range | None) -> list[int]:
    """Write an exit record for each of this node's ranks that started, is no longer running and wrote none
    (killed from outside, or crashed hard), so that the other nodes of the job learn of it from the run
    directory: over NCCL their ranks wait in a collective for the dead one instead of failing. Returns them."""
    dead = []
    for rank in _started(run_dir):
        if (own_ranks is not None and rank not in own_ranks) or rank in alive:
            continue
        try:
            with open(rundir.exit_record(run_dir, rank), "x") as record:
                record.write(f"{rundir.DIED}: {DIED_WHY}")
            dead.append(rank)
        except OSError:
            pass  # it wrote its own (or the disk is gone: the report below still names it)
    return dead


def wait_for_records(run_dir: Path, own_ranks: range, timeout_s: float) -> None:
    """Wait up to `timeout_s` for the exit records of the other nodes' ranks that started: when a node's
    ranks fail together, the record of a rank killed elsewhere comes from its own node's `dstrain run` a
    moment after the launcher here gave up. A rank still running elsewhere never writes one in time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(rundir.exit_record(run_dir, r).exists() for r in _started(run_dir) if r not in own_ranks):
            return
        time.sleep(0.2)


def failure_report(run_dir: Path, alive: set[int], own_ranks: range | None = None) -> list[str]:
    """The lines `dstrain run` prints after a failed run. `alive`: ranks still running when the launcher gave
    up (they were stopped because of another rank, not failed). `own_ranks`: this node's ranks, where other
    nodes run the rest (--no-ssh): another node's rank is said to have died only on its own node's record."""
    started = _started(run_dir)
    records = {r: rundir.exit_record(run_dir, r) for r in started}
    texts = {r: text for r in started if (text := _record_text(records[r])) is not None}
    silent = [r for r in started if (r not in texts and r not in alive and (own_ranks is None or r in own_ranks))
              or texts.get(r, "").startswith(f"{rundir.DIED}: ")]
    if silent:  # no record at all: killed from outside (SIGKILL, the OOM killer) or crashed hard
        return [died_line(run_dir, r) for r in silent]
    failed = sorted((records[r].stat().st_mtime_ns, r, text) for r, text in texts.items() if text != "ok")
    if not failed:
        return []
    _, first, text = failed[0]
    kind, _, detail = text.partition(": ")
    if kind == "error":  # a UserError inside the rank: already a message for people, problems and fixes
        lines = [f"rank {first} failed first: {detail.strip()}"]
    else:
        lines = [f"rank {first} failed first: {short(detail if kind == 'failed' else text)}"]
        found = config_key(text)
        if found:
            lines.append(f"  config key: {found[0]} (fix: {found[1]})")
    lines.append(f"  full log: {rundir.rank_log(run_dir, first)}")
    others = [r for _, r, _ in failed[1:]]
    if others:
        names = ", ".join(str(r) for r in others)
        lines.append(f"  then rank{'s' if len(others) > 1 else ''} {names} failed too "
                     f"({'their logs are' if len(others) > 1 else 'its log is'} beside it)")
    return lines
