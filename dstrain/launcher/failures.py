"""A failed run as one message: the rank that failed first, its exception in a line or two, the config key
responsible where dstrain can tell, and that rank's full log (RUN_DIR/ranks/rank<R>.log).

Read from the records ranks leave under RUN_DIR/ranks/ (dstrain/rank/worker.py); imports neither torch
nor DeepSpeed.
"""

from __future__ import annotations

import re
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


def failure_report(run_dir: Path, alive: set[int]) -> list[str]:
    """The lines `dstrain run` prints after a failed run. `alive`: ranks still running when the launcher gave
    up (they were stopped because of another rank, not failed)."""
    directory = run_dir / rundir.RANKS
    started = sorted(int(p.name[4:-4]) for p in directory.glob("rank*.pid"))
    records = {r: directory / f"rank{r}.exit" for r in started}
    silent = [r for r in started if not records[r].exists() and r not in alive]
    if silent:  # no record at all: killed from outside (SIGKILL, the OOM killer) or crashed hard
        return [f"rank {r} died without reporting (killed by a signal such as SIGKILL, or out of memory); "
                f"its log: {rundir.rank_log(run_dir, r)}" for r in silent]
    texts = {r: records[r].read_text() for r in started if records[r].exists()}
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
