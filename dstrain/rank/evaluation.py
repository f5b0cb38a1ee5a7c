"""Evaluation inside the ranks: the held-out loss the train loop logs, and `dstrain eval`'s ranks.

The launcher side of `dstrain eval` is dstrain/launcher/eval_job.py; it starts these ranks with
`"mode": "eval"` in launch.json.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from dstrain.config.schema import STREAM_EVAL_BATCHES, RunConfig
from dstrain.data.sampler import to_device
from dstrain.data.sequence import Layout
from dstrain.rank import heartbeat
from dstrain.rank.cadence import EarlyStop
from dstrain.rundir import LaunchInfo, write_atomic


@dataclass
class EvalResult:
    loss: float
    samples: int  # held-out samples (rows) evaluated, each once
    examples: int  # examples in them (packed rows hold several)
    of_samples: int | None  # samples in the whole held-out split (None: endless, synthetic)
    metrics: dict = field(default_factory=dict)  # a preference objective's: eval_rewards/margins, ...


def eval_samples(config: RunConfig, sampler) -> int:
    """How many held-out samples one evaluation covers, each once: train.eval_batches global batches,
    at most the split; unset, the whole split of rows and datasets, STREAM_EVAL_BATCHES global batches
    of a token stream."""
    from dstrain.data import TOKEN_SOURCES
    t = config.train
    if t.eval_batches is not None:
        wanted = t.eval_batches * t.global_batch_size
    elif config.data.source in TOKEN_SOURCES:
        wanted = STREAM_EVAL_BATCHES * t.global_batch_size
    else:
        return sampler.size
    return wanted if sampler.size is None else min(wanted, sampler.size)


def evaluate(engine, config: RunConfig, eval_sampler, device) -> EvalResult:
    """The held-out loss over the first `eval_samples` held-out samples, each once, weighted by the
    tokens that take a loss (so it is the mean over every held-out token, however the samples fall
    into batches and ranks).

    The sample set depends on the config, not on the world size. Each rank takes a contiguous share
    in micro batches; every rank runs the same number of forward passes (ZeRO-3 gathers parameters in
    each), a share that runs out being topped up with rows whose labels are all masked.
    A preference objective's loss is its own: see `evaluate_preference`."""
    if config.train.objective != "lm":
        return evaluate_preference(engine, config, eval_sampler, device)
    layout = Layout.of(dist.get_rank(), dist.get_world_size(), config.train.sequence_parallel)
    rank, world = layout.data_rank, layout.data_world  # a sequence-parallel group shares its samples
    micro = config.train.micro_batch_size
    total = eval_samples(config, eval_sampler)
    per_rank = -(-total // world)
    first, last = min(rank * per_rank, total), min((rank + 1) * per_rank, total)
    engine.eval()
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    weight = 0
    with torch.no_grad(), _evaluation_forward(engine) as forward:
        for start in range(first, first + per_rank, micro):
            heartbeat.beat("eval")
            real = max(0, min(micro, last - start))
            batch, tokens = _eval_batch(eval_sampler, start if real else 0, micro, real)
            loss = forward(to_device(layout.share(batch), device))
            if tokens:  # a batch with no loss token returns nan (0 / 0): it adds nothing
                loss_sum += loss.double() * tokens
                weight += tokens
    engine.train()
    counts = torch.tensor([weight, eval_sampler.examples(first, last - first)], device=device, dtype=torch.float64)
    if layout.sequence_rank:  # the group's loss and counts once, from its first rank
        loss_sum.zero_()
        counts.zero_()
    dist.all_reduce(loss_sum)
    dist.all_reduce(counts)
    return EvalResult(loss_sum.item() / max(counts[0].item(), 1), total, int(counts[1].item()), eval_sampler.size)


def evaluate_preference(engine, config: RunConfig, eval_sampler, device) -> EvalResult:
    """A preference objective's held-out loss: the same loss as training (the objective's, against the same
    reference), averaged over the held-out pairs (KTO: examples), each once, with the metrics under TRL's
    names prefixed eval_. Each rank takes a contiguous share of the samples in micro batches; every rank
    runs the same number of forwards (ZeRO-3 gathers in each, KTO all-reduces its KL term), a share that
    runs out running a sample again with weight 0."""
    from dstrain.models.preference import units_in
    from dstrain.rank.preference import PreferenceMetrics
    rank, world = dist.get_rank(), dist.get_world_size()
    micro = config.train.micro_batch_size
    total = eval_samples(config, eval_sampler)
    per_rank = -(-total // world)
    first, last = min(rank * per_rank, total), min((rank + 1) * per_rank, total)
    stats = PreferenceMetrics(config.train.objective, device)
    sums = torch.zeros(2, device=device, dtype=torch.float64)  # loss * pairs, pairs
    engine.eval()
    with torch.no_grad(), _evaluation_forward(engine) as forward:
        for start in range(first, first + per_rank, micro):
            heartbeat.beat("eval")
            real = max(0, min(micro, last - start))
            batch = to_device(eval_sampler.batch(start if real else 0, real or 1), device)
            loss = forward(batch)
            if real:
                units = units_in(batch)
                sums += torch.stack([loss.double() * units, torch.tensor(float(units), device=device,
                                                                         dtype=torch.float64)])
                stats.add(engine.module.preference.last_metrics)
    engine.train()
    examples = torch.tensor([eval_sampler.examples(first, last - first)], device=device, dtype=torch.float64)
    dist.all_reduce(sums)
    dist.all_reduce(examples)
    metrics = {f"eval_{name}": value for name, value in stats.reduce().items()}
    return EvalResult(sums[0].item() / max(sums[1].item(), 1), total, int(examples.item()), eval_sampler.size,
                      metrics)


def _eval_batch(sampler, first: int, micro: int, real: int):
    """(micro samples from `first` of which only the first `real` take a loss, the tokens that do).
    Labelled batches keep their shape (the rest masked); a user's Dataset items get a shorter batch,
    weighted by their number."""
    if real == 0 and not _masks_rows(sampler):
        return sampler.batch(first, 1), 0
    batch = sampler.batch(first, micro if _masks_rows(sampler) else real)
    if isinstance(batch, dict):
        batch["labels"][real:] = -100
        return batch, int((batch["labels"][:, 1:] != -100).sum())
    if isinstance(batch, tuple) and len(batch) == 2 and isinstance(batch[1], torch.Tensor):
        inputs, targets = batch
        targets = targets.clone()
        targets[real:] = -100
        return (inputs, targets), int((targets != -100).sum())
    return batch, real


def _masks_rows(sampler) -> bool:
    """Whether the sampler's batches carry labels dstrain can mask row by row (all but a user's Dataset)."""
    return sampler.real_tokens(0, 1) is not None


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
        result = evaluate(self.engine, self.config, self.eval_sampler, self.device)
        self.metrics.log_eval(step, result.loss, {**coverage(result), **result.metrics}, describe(result))
        last = step == self.config.train.max_steps or stopping
        if not (self.early.update(step, result.loss) and not last):
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


def coverage(result: EvalResult) -> dict:
    """What an evaluation covered, for metrics.jsonl and eval.json."""
    return {"eval_samples": result.samples, "eval_examples": result.examples, "eval_split_samples": result.of_samples}


def describe(result: EvalResult) -> str:
    """'30 held-out examples in 12 rows (the whole held-out split)', say."""
    whole = " (the whole held-out split)" if result.samples == result.of_samples else (
        f" of {result.of_samples:,}" if result.of_samples else "")
    if result.examples != result.samples:
        return f"{result.examples:,} held-out examples in {result.samples:,} rows{whole}"
    return f"{result.samples:,} held-out samples{whole}"


def rank_eval(run_dir: Path, config, ds_config: dict, launch: LaunchInfo) -> int:
    """One evaluation rank (called by dstrain.rank.worker for mode "eval"): build the model as the run
    did, load the checkpoint's weights (not the optimizer), evaluate, rank 0 reports."""
    import torch.distributed as dist

    from dstrain.data import build_samplers
    from dstrain.hangs import collective_timeout_s
    from dstrain.models import build_model
    from dstrain.rank.runtime import init_rank, initialize_engine, quiet_logging, seed_everything, sequence_parallel_mpu

    quiet_logging(launch.verbose)
    rank, world, device = init_rank(collective_timeout_s(launch.hang_timeout_s), ds_config)
    seed_everything(config.train.seed)

    from dstrain.rank.preference import rng_state, set_up_reference
    train_sampler, eval_sampler = build_samplers(config)
    policy_rng = rng_state()
    model = build_model(config, ds_config, device)
    # The run's own DeepSpeed config, optimizer included: ZeRO keeps the fp32 weights in the
    # optimizer's partitions, and loading them is what makes the evaluated weights the trained ones.
    engine = initialize_engine(model, ds_config, config.speedups, sequence_parallel_mpu(model, config, ds_config))
    from dstrain.rank.precomputed import attach_reference
    attach_reference(engine, config, ds_config, (train_sampler, eval_sampler), device)  # before the checkpoint loads
    checkpoint = launch.resume
    path, _ = engine.load_checkpoint(checkpoint.directory, tag=checkpoint.tag, load_optimizer_states=False,
                                     load_lr_scheduler_states=False)
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {checkpoint.tag} from {checkpoint.directory}")
    set_up_reference(model, config, ds_config, device, policy_rng)  # the starting weights, as in training

    result = evaluate(engine, config, eval_sampler, device)
    loss = result.loss
    if rank == 0:
        lm = config.train.objective == "lm"  # a preference objective's loss is no log-likelihood: no perplexity
        record = {"step": checkpoint.step, "tag": checkpoint.tag, "eval_loss": loss,
                  "perplexity": math.exp(loss) if lm and loss < 700 else None,  # exp overflows: JSON has no inf
                  "eval_batches": config.train.eval_batches, **coverage(result),  # as the train loop counts them
                  **result.metrics, "world_size": world,
                  "checkpoint": str(Path(checkpoint.directory) / checkpoint.tag)}
        write_atomic(Path(launch.output), json.dumps(record, indent=2) + "\n")
        perplexity = f"{record['perplexity']:.3f}" if record["perplexity"] is not None else "overflow"
        said = (f"perplexity {perplexity}" if lm else
                f"train.objective {config.train.objective}, reward margin "
                f"{result.metrics.get('eval_rewards/margins', result.metrics.get('eval_margin', float('nan'))):.4f}")
        print(f"step {checkpoint.step} ({checkpoint.tag}): eval loss {loss:.4f}, {said} "
              f"over {describe(result)}; written to {launch.output}", flush=True)
    dist.barrier()
    return 0
