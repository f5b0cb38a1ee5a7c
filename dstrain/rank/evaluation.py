"""Evaluation inside the ranks: the held-out loss the train loop logs, and `dstrain eval`'s ranks.

The launcher side of `dstrain eval` is dstrain/launcher/eval_job.py; it starts these ranks with
`"mode": "eval"` in launch.json.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import torch
import torch.distributed as dist

from dstrain.config.schema import RunConfig
from dstrain.data.sampler import to_device
from dstrain.rank import heartbeat
from dstrain.rank.cadence import EarlyStop
from dstrain.rundir import LaunchInfo, write_atomic


def evaluate(engine, config: RunConfig, eval_sampler, device) -> float:
    """Mean held-out loss over the first eval_batches x global_batch_size held-out samples.

    The sample set depends on the global batch, not on the world size, so a run resumed with
    another number of ranks (same global batch) evaluates the same samples; each rank takes a
    contiguous share in micro batches."""
    rank, world = dist.get_rank(), dist.get_world_size()
    micro = config.train.micro_batch_size
    per_rank = config.train.eval_batches * config.train.global_batch_size // world
    batches = per_rank // micro
    engine.eval()
    total = torch.zeros((), device=device)
    with torch.no_grad(), _evaluation_forward(engine) as forward:
        for i in range(batches):
            heartbeat.beat("eval")
            batch = eval_sampler.batch(rank * per_rank + i * micro, micro)
            total += forward(to_device(batch, device)).float()
    engine.train()
    dist.all_reduce(total)
    return total.item() / (batches * world)


class Evaluator:
    """The train loop's evaluation: due every train.eval_every steps and at the last step (not at a stop
    on request); each result is logged and counted by early stopping (train.early_stop_patience), whose
    count continues from `early_state` (a checkpoint's) on resume."""

    def __init__(self, engine, config: RunConfig, eval_sampler, device, metrics, early_state: dict | None):
        t = config.train
        self.engine, self.config, self.eval_sampler = engine, config, eval_sampler
        self.device, self.metrics = device, metrics
        self.early = EarlyStop(t.early_stop_patience, t.early_stop_min_delta)
        self.early.restore(early_state)

    def should_evaluate(self, step: int, stopping: bool) -> bool:
        t = self.config.train
        return step % t.eval_every == 0 or (step == t.max_steps and not stopping)

    def run(self, step: int, stopping: bool) -> bool:
        """Evaluate and log; True when early stopping ends the run here (never at its last step)."""
        eval_loss = evaluate(self.engine, self.config, self.eval_sampler, self.device)
        self.metrics.log_eval(step, eval_loss)
        last = step == self.config.train.max_steps or stopping
        if not (self.early.update(step, eval_loss) and not last):
            return False
        early = self.early
        self.metrics.log_event("early_stop", step, best_eval_loss=early.best, best_step=early.best_step,
                               evals_without_improvement=early.since_best)
        self.metrics.note(f"early stop at step {step}: the eval loss has not improved for "
                          f"{early.since_best} evaluation(s) (best {early.best:.4f} at step {early.best_step})")
        return True


@contextlib.contextmanager
def _evaluation_forward(engine):
    """The callable evaluation runs the model through: the engine, except under DeepCompile.

    DeepCompile compiles ZeRO-3's gathers into the training graph and removes ZeRO-3's module hooks.
    A no_grad forward through it compiled a second graph, after which the next backward aborted in
    DeepCompile's reduce buckets (DeepSpeed 0.19.8, one H100; docs/benchmarks.md, finding 32).
    Evaluation then runs the model's own forward, uncompiled, with every parameter gathered while it
    lasts: on one GPU, where dstrain turns DeepCompile on, one more 16-bit copy of the model."""
    if not engine.is_deepcompile_active():
        yield engine
        return
    import deepspeed
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        yield engine.module.forward  # the module's forward, not its compiled call


def rank_eval(run_dir: Path, config, ds_config: dict, launch: LaunchInfo) -> int:
    """One evaluation rank (called by dstrain.rank.worker for mode "eval"): build the model as the run
    did, load the checkpoint's weights (not the optimizer), evaluate, rank 0 reports."""
    import torch.distributed as dist

    from dstrain.data import build_samplers
    from dstrain.hangs import collective_timeout_s
    from dstrain.models import build_model
    from dstrain.rank.runtime import init_rank, initialize_engine, quiet_logging, seed_everything

    quiet_logging(launch.verbose)
    rank, world, device = init_rank(collective_timeout_s(launch.hang_timeout_s))
    seed_everything(config.train.seed)

    _, eval_sampler = build_samplers(config)
    model = build_model(config, ds_config, device)
    # The run's own DeepSpeed config, optimizer included: ZeRO keeps the fp32 weights in the
    # optimizer's partitions, and loading them is what makes the evaluated weights the trained ones.
    engine = initialize_engine(model, ds_config)
    checkpoint = launch.resume
    path, _ = engine.load_checkpoint(checkpoint.directory, tag=checkpoint.tag, load_optimizer_states=False,
                                     load_lr_scheduler_states=False)
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {checkpoint.tag} from {checkpoint.directory}")

    loss = evaluate(engine, config, eval_sampler, device)
    if rank == 0:
        t = config.train
        samples = (t.eval_batches * t.global_batch_size // world // t.micro_batch_size) * t.micro_batch_size * world
        result = {"step": checkpoint.step, "tag": checkpoint.tag, "eval_loss": loss,
                  "perplexity": math.exp(loss) if loss < 700 else None,  # exp overflows: JSON has no inf
                  "eval_batches": t.eval_batches, "samples": samples,  # as loop.evaluate counts them
                  "world_size": world, "checkpoint": str(Path(checkpoint.directory) / checkpoint.tag)}
        write_atomic(Path(launch.output), json.dumps(result, indent=2) + "\n")
        perplexity = f"{result['perplexity']:.3f}" if result["perplexity"] is not None else "overflow"
        print(f"step {checkpoint.step} ({checkpoint.tag}): eval loss {loss:.4f}, perplexity {perplexity} "
              f"over {result['samples']} held-out samples; written to {launch.output}", flush=True)
    dist.barrier()
    return 0
