"""`dstrain eval`: the held-out loss of one checkpoint, with the run's own config, preset and world size.

The ranks start exactly as for `dstrain run` (the deepspeed launcher, `dstrain.rank.worker`, the same
supervision), but in a directory of their own, RUN_DIR/eval/: evaluating never rewrites the run's
files or touches its rank records or its lock, so it can run while training goes on (eval/ has a lock
of its own: one evaluation at a time). The worker sees
`"mode": "eval"` in that directory's launch.json and calls `dstrain.rank.evaluation.rank_eval`, which loads the
checkpoint and runs `evaluate` over the configured eval set (each held-out sample once: the whole
held-out split, or train.eval_batches global batches of it; the very samples the train loop
evaluates on, so the number equals the eval_loss in metrics.jsonl at that step). Rank 0 prints the
result, with how many samples and examples it covered, and writes RUN_DIR/eval.json.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml
from rich.console import Console

from dstrain.checkpoints import CompleteCheckpoint, find_resume
from dstrain.console_text import outside
from dstrain.errors import UserError
from dstrain.hardware import cuda_gpu_count, resolve_accelerator
from dstrain.launcher.options import LaunchOptions
from dstrain.launcher.ownership import acquire
from dstrain.launcher.runner import rank_env, runner_command
from dstrain.launcher.supervise import supervise
from dstrain.launcher.topology import JobShape, free_port
from dstrain.rundir import CONFIG, DS_CONFIG, RANKS, SECRETS, LaunchInfo, ResumeTarget, missing_files, write_atomic

EVAL_DIR = "eval"
RESULT = "eval.json"


def evaluate_run(run_dir: Path, resume: str, accelerator: str, verbose: bool) -> int:
    """Launch evaluation ranks for the checkpoint `resume` names in `run_dir`; returns the exit code."""
    console = Console(highlight=False)
    run_dir = Path(run_dir)
    missing = missing_files(run_dir)
    if missing:
        raise UserError.single(f"not a dstrain run directory (no {', '.join(missing)})", f"--run-dir {run_dir}",
                               "give the --run-dir of a `dstrain run`")
    if accelerator not in ("auto", "cuda", "cpu"):
        raise UserError.single(f"unknown accelerator {accelerator!r}", "--accelerator", "use auto, cuda or cpu")
    found, notes = find_resume(resume, run_dir)
    saved = LaunchInfo.read(run_dir)
    acc = _check_target(run_dir, resume, found, saved, accelerator)
    for note in notes:
        console.print(f"[yellow]note:[/] {outside(note)}")
    if acc != saved.accelerator:
        console.print(f"[yellow]note:[/] the run trained with accelerator {outside(saved.accelerator)}; "
                      f"evaluating on {acc}")

    eval_dir = run_dir / EVAL_DIR
    eval_dir.mkdir(exist_ok=True)
    # Its own lock on its own folder: evaluations exclude each other, never the training job.
    lock = acquire(eval_dir, f"--run-dir {run_dir} (its {EVAL_DIR}/ folder, used by `dstrain eval`)")
    try:
        if lock.note:
            console.print(f"[yellow]note:[/] {outside(lock.note)}", soft_wrap=True)
        return _launch_eval(run_dir, eval_dir, found, saved, acc, verbose, console)
    finally:
        lock.release()


def _launch_eval(run_dir: Path, eval_dir: Path, found: CompleteCheckpoint, saved: LaunchInfo, acc: str, verbose: bool,
                 console: Console) -> int:
    world = found.world_size
    _write_eval_dir(run_dir, eval_dir, found, saved, acc, verbose)
    train = yaml.safe_load((run_dir / CONFIG).read_text())["train"]
    console.print(f"evaluating {outside(found.tag)} (step {found.step}) of {outside(run_dir)}: "
                  f"preset {outside(saved.preset or '(none)')}, "
                  f"{world} ranks on {acc}, " + (f"up to {train['eval_batches']} x {train['global_batch_size']} held-out "
                                                  "samples" if train.get("eval_batches") else "the held-out split") +
                  ", each once",
                  soft_wrap=True)
    options = LaunchOptions(gpus=world, nodes=1, accelerator=acc, verbose=verbose)
    shape = JobShape(ranks=world, nodes=1, hosts=None, active={"localhost": world}, own_ranks=None)
    command = runner_command(options, shape, eval_dir, free_port())
    code = supervise(command, rank_env(acc, world), eval_dir, verbose, console,
                     hang_timeout_s=saved.hang_timeout_s)
    if code == 0 and not (run_dir / RESULT).is_file():
        console.print(f"[bold red]evaluation failed[/]: the ranks ended without writing {outside(run_dir / RESULT)}")
        return 1
    return code


def _check_target(run_dir: Path, resume: str, found: CompleteCheckpoint, saved: LaunchInfo, accelerator: str) -> str:
    """Refuse a checkpoint of another config or more ranks than GPUs; returns the accelerator to use."""
    mark_hash = found.mark.get("config_hash")
    if mark_hash and mark_hash != saved.config_hash:
        raise UserError.single(f"checkpoint {found.tag} was saved with a different model/data config than "
                               f"{run_dir / CONFIG}", f"--resume {resume}",
                               "evaluate it from the run directory it was trained in")
    # "auto" means the run's own accelerator: its ds_config.json was rendered for it.
    acc = saved.accelerator if accelerator == "auto" else resolve_accelerator(accelerator)
    world = found.world_size
    if acc == "cuda" and cuda_gpu_count() < world:
        raise UserError.single(f"checkpoint {found.tag} was saved by {world} ranks; this machine has "
                               f"{cuda_gpu_count()} GPUs", "--run-dir",
                               f"evaluate on a machine with {world} GPUs (ZeRO shards are per rank)")
    return acc


def _write_eval_dir(run_dir: Path, eval_dir: Path, found: CompleteCheckpoint, saved: LaunchInfo, acc: str,
                    verbose: bool) -> None:
    """RUN_DIR/eval/: the run's config files and a launch.json in eval mode; the run's own files stay."""
    (eval_dir / RANKS).mkdir(parents=True, exist_ok=True)
    for stale in (eval_dir / RANKS).glob("rank*"):
        stale.unlink()
    for name in (CONFIG, DS_CONFIG):
        write_atomic(eval_dir / name, (run_dir / name).read_text())
    if (run_dir / SECRETS).exists():
        shutil.copyfile(run_dir / SECRETS, eval_dir / SECRETS)
        (eval_dir / SECRETS).chmod(0o600)
    target = ResumeTarget(directory=str(found.directory.resolve()), tag=found.tag, step=found.step, universal=False)
    saved.model_copy(update={"mode": "eval", "verbose": verbose, "world_size": found.world_size, "accelerator": acc,
                             "resume": target, "output": str((run_dir / RESULT).resolve())}).write(eval_dir)
    (run_dir / RESULT).unlink(missing_ok=True)  # a result left from an earlier evaluation must not pass for this one
