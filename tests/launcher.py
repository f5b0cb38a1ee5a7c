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


def dstrain(*args: str, timeout: float = 600, env: dict | None = None, in_process: bool = True,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run a dstrain command as a user would and capture its output.

    In-process by default: the CLI's own code (Typer app, checks, plan, the real `deepspeed` launcher and its
    ranks, supervision) runs in this test process, which has torch and DeepSpeed imported already, so a launch
    does not pay a fresh interpreter's ~4 s of CPU for those imports. `in_process=False` (or
    DSTRAIN_TESTS_CLI_SUBPROCESS=1 for the whole session) runs `python -m dstrain.cli` instead, for tests
    of the process itself: its signals, its imports, its exit. `cwd`: the folder it runs in (a user's modules
    next to the config are found there, as `python -m` finds them)."""
    if not in_process or os.environ.get("DSTRAIN_TESTS_CLI_SUBPROCESS") == "1":
        full_env = {**os.environ, **(env or {})}
        return subprocess.run([sys.executable, "-m", "dstrain.cli", *args], capture_output=True, text=True,
                              timeout=timeout, env=full_env, cwd=cwd)
    return _dstrain_in_process(list(args), timeout, env or {}, cwd)


def _dstrain_in_process(args: list[str], timeout: float, env: dict, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The CLI in this process, with what a command changes put back afterwards: the environment (the CLI
    sets DeepSpeed's accelerator and op cache for its ranks), sys.path, modules imported from outside the
    installed packages (a user's model module of one test must not be another test's), the signal handlers
    and the warning filters. A command that outlives `timeout` ends this process with the stacks, as a
    subprocess's timeout would end the test."""
    import faulthandler
    import signal
    import traceback
    import warnings

    from dstrain.cli import app

    saved_env, saved_path, saved_modules = dict(os.environ), list(sys.path), set(sys.modules)
    saved_signals = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    saved_cwd = os.getcwd()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    faulthandler.dump_traceback_later(timeout, exit=True)
    try:
        with warnings.catch_warnings():
            result = _runner().invoke(app, args)
    finally:
        faulthandler.cancel_dump_traceback_later()
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        sys.path[:] = saved_path
        for name in set(sys.modules) - saved_modules:
            if _outside_installed_packages(sys.modules[name]):
                del sys.modules[name]
        for sig, handler in saved_signals.items():
            signal.signal(sig, handler)
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        # what the interpreter prints for an uncaught exception, as a subprocess's stderr would show it
        stderr += "".join(traceback.format_exception(result.exception))
    return subprocess.CompletedProcess(["dstrain", *args], result.exit_code, result.stdout, stderr)


def _runner():
    from typer.testing import CliRunner
    try:
        return CliRunner(mix_stderr=False)  # click < 8.2 mixes stderr into stdout unless told
    except TypeError:
        return CliRunner()  # click >= 8.2 keeps them apart


def _outside_installed_packages(module) -> bool:
    """A Python module from a user's folder (a compiled extension, such as a DeepSpeed op, stays loaded)."""
    path = getattr(module, "__file__", None) or ""
    packages = (str(Path(__file__).resolve().parents[1] / "dstrain"), sys.prefix, sys.base_prefix)
    return path.endswith(".py") and not any(path.startswith(root) for root in packages)


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
