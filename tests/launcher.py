"""Helpers for tests that start real ranks through `dstrain run` and the deepspeed launcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# A model small enough that a CPU rank steps in milliseconds; the launcher and ZeRO are the real ones.
TINY = ["model.n_layer=2", "model.n_head=2", "model.d_model=32", "data.seq_len=32", "train.micro_batch_size=4",
        "train.eval_batches=2"]


def dstrain(*args: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the dstrain CLI in a subprocess (as a user would), capturing its output."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "dstrain.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env)


def run_tiny(run_dir: Path, preset: str, *sets: str, resume: str | None = None, gpus: int = 2,
             extra: tuple[str, ...] = (), env: dict | None = None) -> subprocess.CompletedProcess:
    args = ["run", "--preset", preset, "--accelerator", "cpu", "--gpus", str(gpus), "--run-dir", str(run_dir)]
    for item in (*TINY, *sets):
        args += ["--set", item]
    if resume:
        args += ["--resume", resume]
    return dstrain(*args, *extra, env=env)


def run_hf(run_dir: Path, preset: str, model_dir: Path, *sets: str, gpus: int = 2) -> subprocess.CompletedProcess:
    """A tiny Hugging Face model folder (tests/hf_models.py) fine-tuned on bytes, 2 steps unless `sets` say so."""
    args = ["run", "--preset", preset, "--accelerator", "cpu", "--gpus", str(gpus), "--run-dir", str(run_dir)]
    for item in (f"model.name=hf:{model_dir}", "data.tokenizer=byte", "data.seq_len=32", "train.micro_batch_size=2",
                 "train.max_steps=2", "train.log_every=1", "train.eval_batches=1", "train.eval_every=1000", *sets):
        args += ["--set", item]
    return dstrain(*args)


def losses(run_dir: Path) -> dict[int, float]:
    """step -> training loss from metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


def cpu_ranks_support_fp16() -> bool:
    """DeepSpeed's own answer on this machine, the question pre-flight asks: its CPU accelerator runs fp16
    where oneDNN does (CPUs with avx512_fp16 / AMX-FP16) and refuses it elsewhere. Machines of one kind differ
    here, so a test checks the side this machine is on instead of assuming one."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
    return bool(CPU_Accelerator().is_fp16_supported())


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}"
