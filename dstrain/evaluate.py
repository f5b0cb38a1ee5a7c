"""`dstrain eval`: the held-out loss of one checkpoint, with the run's own config, preset and world size.

The ranks start exactly as for `dstrain run` (the deepspeed launcher, `dstrain.worker`, the same
supervision), but in a directory of their own, RUN_DIR/eval/: evaluating never rewrites the run's
files or touches its rank records, so it can run while training goes on. The worker sees
`"mode": "eval"` in that directory's launch.json and calls `rank_eval` below, which loads the
checkpoint and runs `loop.evaluate` over the configured eval set (train.eval_batches global batches
of held-out samples: the very samples the train loop evaluates on, so the number equals the
eval_loss in metrics.jsonl at that step). Rank 0 prints the result and writes RUN_DIR/eval.json.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

EVAL_DIR = "eval"
RESULT = "eval.json"


def evaluate_run(run_dir: Path, resume: str, accelerator: str, verbose: bool) -> int:
    """Launch evaluation ranks for the checkpoint `resume` names in `run_dir`; returns the exit code."""
    import yaml
    from rich.console import Console

    from dstrain.checkpoint import find_resume, write_atomic
    from dstrain.errors import UserError
    from dstrain.hardware import cuda_gpu_count, resolve_accelerator
    from dstrain.launch import LaunchOptions, _free_port, _rank_env, _runner_command, supervise
    from dstrain.worker import RANKS_DIR

    console = Console(highlight=False)
    run_dir = Path(run_dir)
    missing = [name for name in ("config.yaml", "ds_config.json", "launch.json") if not (run_dir / name).is_file()]
    if missing:
        raise UserError.single(f"not a dstrain run directory (no {', '.join(missing)})", f"--run-dir {run_dir}",
                               "give the --run-dir of a `dstrain run`")
    if accelerator not in ("auto", "cuda", "cpu"):
        raise UserError.single(f"unknown accelerator {accelerator!r}", "--accelerator", "use auto, cuda or cpu")
    found, notes = find_resume(resume, run_dir)
    saved = json.loads((run_dir / "launch.json").read_text())
    mark_hash = found.mark.get("config_hash")
    if mark_hash and saved.get("config_hash") and mark_hash != saved["config_hash"]:
        raise UserError.single(f"checkpoint {found.tag} was saved with a different model/data config than "
                               f"{run_dir / 'config.yaml'}", f"--resume {resume}",
                               "evaluate it from the run directory it was trained in")

    # "auto" means the run's own accelerator: its ds_config.json was rendered for it.
    acc = saved["accelerator"] if accelerator == "auto" else resolve_accelerator(accelerator)
    world = found.world_size
    if acc == "cuda" and cuda_gpu_count() < world:
        raise UserError.single(f"checkpoint {found.tag} was saved by {world} ranks; this machine has "
                               f"{cuda_gpu_count()} GPUs", "--run-dir",
                               f"evaluate on a machine with {world} GPUs (ZeRO shards are per rank)")
    for note in notes:
        console.print(f"[yellow]note:[/] {note}")
    if acc != saved["accelerator"]:
        console.print(f"[yellow]note:[/] the run trained with accelerator {saved['accelerator']}; evaluating on {acc}")

    eval_dir = run_dir / EVAL_DIR
    (eval_dir / RANKS_DIR).mkdir(parents=True, exist_ok=True)
    for stale in (eval_dir / RANKS_DIR).glob("rank*"):
        stale.unlink()
    for name in ("config.yaml", "ds_config.json"):
        write_atomic(eval_dir / name, (run_dir / name).read_text())
    if (run_dir / ".secrets.json").exists():
        shutil.copyfile(run_dir / ".secrets.json", eval_dir / ".secrets.json")
        (eval_dir / ".secrets.json").chmod(0o600)
    launch_info = {**saved, "mode": "eval", "verbose": verbose, "world_size": world, "accelerator": acc,
                   "resume": {"directory": str(found.directory.resolve()), "tag": found.tag, "step": found.step},
                   "output": str((run_dir / RESULT).resolve())}
    write_atomic(eval_dir / "launch.json", json.dumps(launch_info, indent=2))
    (run_dir / RESULT).unlink(missing_ok=True)  # a result left from an earlier evaluation must not pass for this one

    train = yaml.safe_load((run_dir / "config.yaml").read_text())["train"]
    console.print(f"evaluating {found.tag} (step {found.step}) of {run_dir}: preset {saved.get('preset') or '(none)'}, "
                  f"{world} ranks on {acc}, {train['eval_batches']} x {train['global_batch_size']} held-out samples",
                  soft_wrap=True)
    options = LaunchOptions(gpus=world, nodes=1, accelerator=acc, verbose=verbose)
    command = _runner_command(options, world, 1, eval_dir, _free_port())
    code = supervise(command, _rank_env(acc, world), eval_dir, verbose, console)
    if code == 0 and not (run_dir / RESULT).is_file():
        console.print(f"[bold red]evaluation failed[/]: the ranks ended without writing {run_dir / RESULT}")
        return 1
    return code


# ---------------------------------------------------------------- inside each rank

def rank_eval(run_dir: Path, config, ds_config: dict, launch: dict) -> int:
    """One evaluation rank (called by dstrain.worker for mode "eval"): build the model as the run
    did, load the checkpoint's weights (not the optimizer), evaluate, rank 0 reports."""
    import os

    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    from dstrain.checkpoint import write_atomic
    from dstrain.data import build_samplers
    from dstrain.loop import evaluate
    from dstrain.models import build_model
    from dstrain.worker import _quiet, _seed_everything

    _quiet(launch["verbose"])
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    if get_accelerator().device_name() == "cuda":
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    _seed_everything(config.train.seed)

    _, eval_sampler = build_samplers(config)
    model = build_model(config, ds_config, device)
    # The run's own DeepSpeed config, optimizer included: ZeRO keeps the fp32 weights in the
    # optimizer's partitions, and loading them is what makes the evaluated weights the trained ones.
    engine, _, _, _ = deepspeed.initialize(model=model, config=ds_config,
                                           model_parameters=[p for p in model.parameters() if p.requires_grad])
    checkpoint = launch["resume"]
    path, _ = engine.load_checkpoint(checkpoint["directory"], tag=checkpoint["tag"], load_optimizer_states=False,
                                     load_lr_scheduler_states=False)
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {checkpoint['tag']} from {checkpoint['directory']}")

    loss = evaluate(engine, config, eval_sampler, device)
    if rank == 0:
        t = config.train
        samples = (t.eval_batches * t.global_batch_size // world // t.micro_batch_size) * t.micro_batch_size * world
        result = {"step": checkpoint["step"], "tag": checkpoint["tag"], "eval_loss": loss,
                  "perplexity": math.exp(loss) if loss < 700 else None,  # exp overflows: JSON has no inf
                  "eval_batches": t.eval_batches, "samples": samples,  # as loop.evaluate counts them
                  "world_size": world, "checkpoint": str(Path(checkpoint["directory"]) / checkpoint["tag"])}
        write_atomic(Path(launch["output"]), json.dumps(result, indent=2) + "\n")
        perplexity = f"{result['perplexity']:.3f}" if result["perplexity"] is not None else "overflow"
        print(f"step {checkpoint['step']} ({checkpoint['tag']}): eval loss {loss:.4f}, perplexity {perplexity} "
              f"over {result['samples']} held-out samples; written to {launch['output']}", flush=True)
    dist.barrier()
    return 0
