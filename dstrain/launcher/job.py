"""`dstrain run`: resolve and check everything, write the run directory, start the ranks through
the real `deepspeed` launcher, and supervise them.

Order matters for the user: every check that can fail on bad input (config, DeepSpeed's own
models, the model and data entry points, the hostfile, the checkpoint to resume) runs before
anything is written or spawned, so a typo costs seconds, not a GPU allocation.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import signal
import time
from pathlib import Path

from rich.console import Console

from dstrain import __version__
from dstrain.checkpoints import find_resume, find_resume_auto
from dstrain.config.preference import (NOT_IMPLEMENTED_REFERENCE, OBJECTIVES_WITHOUT_REFERENCE,
                                       PRECOMPUTED_OBJECTIVES)
from dstrain.config.resolve import ResolvedConfig, resolve
from dstrain.console_text import outside
from dstrain.errors import UserError
from dstrain.hangs import hang_timeout_s
from dstrain.hardware import resolve_accelerator
from dstrain.launcher import early_start
from dstrain.launcher.env_fixes import use_bytecode_cache
from dstrain.op_cache import use_private_op_cache
from dstrain.launcher.preflight import check_runtime, clear_stale_build_locks
from dstrain.launcher.nodes import node_layout
from dstrain.launcher.options import LaunchOptions
from dstrain.launcher.ownership import current_holder, multi_node_job_id
from dstrain.launcher.run_directory import (default_run_dir, prepare_run_dir, refuse_checkpoints, universal_copy,
                                            write_run_dir)
from dstrain.launcher.runner import is_local_job, rank_env, runner_command
from dstrain.launcher.supervise import supervise
from dstrain.launcher.topology import MPI_LAUNCHERS, JobShape, job_shape, master_port
from dstrain.rundir import CONFIG, SECRETS, LaunchInfo, ResumeTarget


STOPPED_CLEANLY = (128 + signal.SIGTERM, 128 + signal.SIGINT)  # supervise.py's exit codes after a clean stop


def launch(o: LaunchOptions) -> int:
    """Run `dstrain run` with options `o`; returns the process exit code."""
    console = Console(highlight=False)
    if o.accelerator not in ("auto", "cuda", "cpu"):
        raise UserError.single(f"unknown accelerator {o.accelerator!r}", "--accelerator", "use auto, cuda or cpu")
    accelerator = resolve_accelerator(o.accelerator)
    os.environ["DS_ACCELERATOR"] = accelerator  # DeepSpeed, imported for the checks below, asks no more
    use_private_op_cache(os.environ, accelerator)  # this environment's op builds: here (stale locks) and in the ranks
    use_bytecode_cache()  # before this process and the ranks import torch
    shape = job_shape(o, accelerator)
    _warn_about_launcher(o, shape, console)
    frozen = _frozen_config(o)
    preset, sets = _preset(o, shape, accelerator, console)
    if o.join_timeout_s is not None:  # --join-timeout: this launch's train.join_timeout_s, frozen with the rest
        sets = [*sets, f"train.join_timeout_s={o.join_timeout_s}"]
    resolved = resolve(preset, frozen or o.config_file, sets, world_size=shape.world, accelerator=accelerator,
                       strict=o.strict)
    if frozen:
        console.print(f"[yellow]note:[/] --resume without --config or --preset: the run directory's own config "
                      f"{outside(frozen)} is used (--set still overrides it)", soft_wrap=True)
        _restore_secrets(resolved, frozen.parent)
    _refuse_untrained(resolved, o.dry_run)
    run_dir = Path(o.run_dir or default_run_dir(resolved))
    port = master_port(o, shape)
    command = runner_command(o, shape, run_dir, port)
    early = None
    if not o.dry_run and is_local_job(o, shape.nodes) and early_start.wanted(resolved.ds_config):
        early = early_start.EarlyStart(command, rank_env(accelerator, max(shape.active.values())))
    try:
        return _check_and_start(o, shape, resolved, accelerator, run_dir, port, command, early, console)
    except BaseException:
        if early is not None:
            early.cancel()
        raise


def _refuse_untrained(resolved: ResolvedConfig, dry_run: bool) -> None:
    """What the loop does not train yet is refused before anything starts (a dry run checks it all): the
    precomputed reference of KTO (issue 52)."""
    if dry_run:
        return
    objective = resolved.config.train.objective
    reference = resolved.config.preference.reference
    if reference == "precomputed" and objective not in (*PRECOMPUTED_OBJECTIVES, *OBJECTIVES_WITHOUT_REFERENCE):
        raise UserError.single(NOT_IMPLEMENTED_REFERENCE, "preference.reference",
                               "set preference.reference: adapters_off (with model.lora) or model (a frozen copy), "
                               "or auto")


def _check_and_start(o: LaunchOptions, shape: JobShape, resolved: ResolvedConfig, accelerator: str, run_dir: Path,
                     port: int, command: list[str], early: early_start.EarlyStart | None, console: Console) -> int:
    """The checks that import torch and DeepSpeed, the plan, then the run directory and the ranks."""
    params = check_runtime(resolved)  # (total, trainable)
    for warning in resolved.warnings:
        warn(warning)

    resume_info, notes = _resume_target(o, run_dir, resolved, shape.world)
    _print_plan(resolved, shape.world, accelerator, params, notes, resume_info, console)
    clear_stale_build_locks(console, o.dry_run)
    if o.dry_run:
        refuse_checkpoints(Path(run_dir), resuming=resume_info is not None)
        holder = current_holder(Path(run_dir))
        if holder is not None:
            warn(f"the run directory belongs to a running job ({holder.describe()}): this run would be refused")
        console.print(f"run directory: {outside(run_dir)} (not written: --dry-run)")
        console.print("would run: " + outside(shlex.join(command)), soft_wrap=True)
        return 0

    lock = prepare_run_dir(run_dir, resuming=resume_info is not None, job=_job_id(o, shape, port))
    try:
        if lock.note:
            console.print(f"[yellow]note:[/] {outside(lock.note)}", soft_wrap=True)
        return _start(o, shape, resolved, accelerator, run_dir, resume_info, command, early, console)
    finally:
        lock.release()


def _start(o: LaunchOptions, shape: JobShape, resolved: ResolvedConfig, accelerator: str, run_dir: Path,
           resume_info: ResumeTarget | None, command: list[str], early: early_start.EarlyStart | None,
           console: Console) -> int:
    """Write the run directory (owned by this job now), let the ranks go (or start them) and supervise."""
    if resume_info and resume_info.universal:
        universal = universal_copy(Path(resume_info.directory), resume_info.tag, run_dir)
        resume_info = resume_info.model_copy(update={"directory": str(universal)})
    launch_info = LaunchInfo(mode="train", resume=resume_info, verbose=o.verbose, preset=resolved.preset,
                             world_size=shape.world, config_hash=resolved.config_hash(), dstrain_version=__version__,
                             accelerator=accelerator,
                             hang_timeout_s=hang_timeout_s(resolved.config.train.hang_timeout_s, accelerator))
    write_run_dir(run_dir, resolved, launch_info, shape.own_ranks)
    _save_model_source(resolved, run_dir)
    console.print(f"run directory: {outside(run_dir)}")
    started = time.time()
    # Ranks started early have their environment already (rank_env prints its notes once).
    env = rank_env(accelerator, max(shape.active.values())) if early is None else {}
    try:
        train = resolved.config.train
        code = supervise(command, env, run_dir, o.verbose, console, shape.own_ranks,
                         saves=train.save_checkpoints, hang_timeout_s=launch_info.hang_timeout_s,
                         started=early.open() if early else None, nodes=node_layout(shape.active),
                         join_timeout_s=train.join_timeout_s, liveness_timeout_s=train.liveness_timeout_s)
    finally:
        if early is not None:
            early.remove()
    if code == 0 or code in STOPPED_CLEANLY:  # finished, or stopped cleanly by a signal (not a launcher's 247)
        _print_summary(Path(run_dir), started, accelerator, console)
    return code


def _print_summary(run_dir: Path, started: float, accelerator: str, console: Console) -> None:
    """The run in a few numbers and the commands to type next, from what rank 0 wrote to metrics.jsonl
    in this session (nothing when rank 0 ran elsewhere, on another node without this run directory)."""
    from dstrain.run_summary import load_records, next_commands, summarize, summary_lines
    try:
        records = load_records(run_dir)
    except UserError:
        return
    starts = [r for r in records if r.get("event") == "run_start"]
    if not starts or starts[-1].get("time", 0) < started:
        return
    summary = summarize(run_dir, records)
    for line in summary_lines(summary, time.time() - started):
        console.print(outside(line), soft_wrap=True)
    console.print("next:")
    for command in next_commands(summary, accelerator):
        console.print(f"  {outside(command)}", soft_wrap=True)


def warn(text: str) -> None:
    """Warnings go to stderr, so `dstrain run ... > plan.txt` keeps the plan and shows the warnings."""
    Console(stderr=True, highlight=False).print(f"[yellow]warning:[/] {outside(text)}", soft_wrap=True)


def _job_id(o: LaunchOptions, shape: JobShape, port: int) -> str | None:
    """Nodes started one by one (--no-ssh) share the run directory as one job; others never share."""
    return multi_node_job_id(o.master_addr, port, shape.nodes) if o.no_ssh and shape.nodes > 1 else None


def _save_model_source(resolved: ResolvedConfig, run_dir: Path) -> None:
    """An hf: model's config and tokenizer files go into the run directory, for `--format hf` export."""
    from dstrain.models import hf
    if hf.is_hf(resolved.config.model.name):
        hf.save_source(resolved.config, run_dir)


def _frozen_config(o: LaunchOptions) -> Path | None:
    """The run directory's config.yaml when --resume names no config of its own (no --config, no --preset):
    a run continues with what it was started with, not with dstrain's defaults."""
    if not o.resume or o.config_file is not None or o.preset is not None or o.run_dir is None:
        return None
    frozen = Path(o.run_dir) / CONFIG
    return frozen if frozen.is_file() else None


def _restore_secrets(resolved: ResolvedConfig, run_dir: Path) -> None:
    """config.yaml holds "<redacted>" where the DeepSpeed config had secrets; .secrets.json their values."""
    import json

    from dstrain.config.layers import set_path
    secrets = run_dir / SECRETS
    if secrets.is_file():
        for path, value in json.loads(secrets.read_text()).items():
            set_path(resolved.ds_config, path, value)


def _warn_about_launcher(o: LaunchOptions, shape: JobShape, console: Console) -> None:
    if o.launcher and len(shape.active) == 1:
        warn(f"--launcher {o.launcher} is not used: one node runs locally "
             "(the launcher starts several nodes from a --hostfile)")
    elif o.launcher in (*MPI_LAUNCHERS, "slurm") and importlib.util.find_spec("mpi4py") is None:
        warn(f"ranks started by {o.launcher} find each other through mpi4py, which is "
             "not installed here: pip install mpi4py (on every node)")


def _preset(o: LaunchOptions, shape: JobShape, accelerator: str, console: Console) -> tuple[str | None, list[str]]:
    """The preset to resolve and the --set list: the preset named, or for `--preset auto` the fastest that
    fits, with the train.sequence_parallel it needs where sequences fit only split over ranks."""
    if not (o.preset and o.preset.strip().lower() == "auto"):
        return o.preset, o.sets
    from dstrain.tools.estimate.planner import choose_preset
    preset, reason, degree = choose_preset(o.config_file, o.sets, shape.ranks, shape.nodes, accelerator)
    console.print(f"--preset auto: {outside(preset)} ({outside(reason)})")
    return preset, [*o.sets, f"train.sequence_parallel={degree}"] if degree > 1 else o.sets


def _resume_target(o: LaunchOptions, run_dir: Path, resolved: ResolvedConfig,
                   world: int) -> tuple[ResumeTarget | None, list[str]]:
    """What launch.json's "resume" says (None without --resume), and notes for the user."""
    if not o.resume:
        return None, []
    hashes = resolved.config.train.verify_hashes_on_resume
    if o.resume == "auto":
        if o.run_dir is None:
            raise UserError.single("--resume auto continues the run in --run-dir, but no --run-dir was given",
                                   "--resume auto", "name the run directory with --run-dir (the same one every time)")
        found, notes = find_resume_auto(run_dir, hashes)
        if found is None:
            return None, notes
    else:
        found, notes = find_resume(o.resume, run_dir, hashes=hashes)
    saved_hash = found.mark.get("config_hash")
    if saved_hash and saved_hash != resolved.config_hash():
        raise UserError.single(f"checkpoint {found.tag} was saved with a different model/data config",
                               f"--resume {o.resume}", "resume with the model section it was trained with")
    resume_info = ResumeTarget(directory=str(found.directory.resolve()), tag=found.tag, step=found.step,
                               universal=found.world_size != world)
    if resume_info.universal:
        # ZeRO shards are cut for one world size: reshape through DeepSpeed's universal checkpoint.
        notes.append(f"{found.tag} was saved by {found.world_size} ranks and this run has {world}: "
                     "resuming through a universal checkpoint (converted once, kept under universal/)")
        resolved.ds_config.setdefault("checkpoint", {})["load_universal"] = True
    return resume_info, notes


def _print_plan(resolved: ResolvedConfig, world: int, accelerator: str, params: tuple[int, int], notes: list[str],
                resume_info: ResumeTarget | None, console: Console) -> None:
    from dstrain.config.show import plan_lines
    for line in plan_lines(resolved.config, resolved.ds_config, world, accelerator, resolved.preset, *params):
        console.print(outside(line), soft_wrap=True)  # the plan quotes the model name
    for note in notes:
        console.print(f"[yellow]note:[/] {outside(note)}")
    if resume_info:
        console.print(f"resume: {outside(resume_info.tag)} (step {resume_info.step}) from "
                      f"{outside(resume_info.directory)}")
