"""One rank of a run: `python -m dstrain.worker RUN_DIR`, spawned by the deepspeed launcher.

Everything the rank needs is in RUN_DIR (config.yaml, ds_config.json, launch.json), written by
`dstrain run` before launching; nothing is passed as flags, since the deepspeed runner would
parse abbreviated flags meant for us. Each rank records its pid and how it ended under
RUN_DIR/ranks/, so `dstrain run` can name the rank that failed.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import sys
import time
import traceback
import warnings
from pathlib import Path

if __name__ == "__main__" and sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    # Run as a file (DeepSpeed's slurm backend has no -m): dstrain/ itself must not shadow
    # top-level modules, e.g. a user's `models` or `data` named in an entry point.
    sys.path.pop(0)

RANKS_DIR = "ranks"
# Ranks started by mpirun or srun learn RANK only inside deepspeed.init_distributed; the rank
# records written before that read the launcher's own variable.
_RANK_VARIABLES = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK", "SLURM_PROCID")


def _rank() -> int:
    return int(next((os.environ[v] for v in _RANK_VARIABLES if v in os.environ), "0"))


def record(run_dir: Path, name: str, text: str) -> None:
    """Best effort: a full or vanished disk must not turn a rank's report into a second traceback."""
    try:
        directory = run_dir / RANKS_DIR
        directory.mkdir(exist_ok=True)
        (directory / f"rank{_rank()}.{name}").write_text(text)
    except OSError as err:
        print(f"rank {_rank()}: cannot record {name} under {run_dir / RANKS_DIR}: {err}", file=sys.stderr)


def _catch_stop_signals() -> tuple[list[str], dict]:
    """Note SIGTERM/SIGINT instead of dying until the train loop's handler takes over, so a stop
    request that comes while torch is still importing is not lost. Returns (caught, previous handlers)."""
    caught: list[str] = []

    def note(signum, _frame):
        caught.append(signal.Signals(signum).name)
    return caught, {s: signal.signal(s, note) for s in (signal.SIGTERM, signal.SIGINT)}


def _quiet(verbose: bool) -> None:
    """DeepSpeed's own logging at warning level unless --verbose; known-harmless warnings hidden."""
    if verbose:
        return
    from deepspeed.utils import logger as ds_logger
    ds_logger.setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*")
    warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor.*")
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")


def _load_run_dir(run_dir: Path):
    import yaml
    from dstrain.config.schema import RunConfig
    config = RunConfig.model_validate(yaml.safe_load((run_dir / "config.yaml").read_text()))
    ds_config = json.loads((run_dir / "ds_config.json").read_text())
    secrets_file = run_dir / ".secrets.json"
    if secrets_file.exists():  # secrets are kept out of the readable config files
        from dstrain.config.layers import set_path
        for path, value in json.loads(secrets_file.read_text()).items():
            set_path(ds_config, path, value)
    launch = json.loads((run_dir / "launch.json").read_text())
    return config, ds_config, launch


def run(run_dir: Path, caught: list[str], previous_handlers: dict) -> int:
    config, ds_config, launch = _load_run_dir(run_dir)
    if launch.get("mode") == "eval":  # `dstrain eval` (launch.json of training runs has no mode)
        for sig, handler in previous_handlers.items():  # nothing to save: a stop request ends it
            signal.signal(sig, handler)
        if caught:
            signal.raise_signal(signal.Signals[caught[0]])
        from dstrain.evaluate import rank_eval
        return rank_eval(run_dir, config, ds_config, launch)
    from dstrain.loop import StopRequest
    stop = StopRequest()
    stop.install()  # before the slow start-up, so an early SIGTERM is not lost
    if caught:
        stop.signal_name = caught[0]

    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    _quiet(launch["verbose"])
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    accelerator = get_accelerator()
    if accelerator.device_name() == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    _seed_everything(config.train.seed)

    from dstrain import checkpoint
    from dstrain.data import build_samplers
    from dstrain.metrics import MetricsLog
    from dstrain.models import build_model
    from dstrain.loop import train

    started = time.perf_counter()
    train_sampler, eval_sampler = build_samplers(config)
    model = build_model(config, ds_config, device)
    if config.train.activation_checkpointing:
        _enable_activation_checkpointing(model, ds_config, rank)

    engine, _, _, _ = deepspeed.initialize(model=model, config=ds_config,
                                           model_parameters=[p for p in model.parameters() if p.requires_grad])
    from dstrain.config.resolve import redact
    engine.config = redact(ds_config)  # DeepSpeed stores this dict in every checkpoint: no API keys there
    if config.train.compile:
        engine.compile()
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())

    start_step = 0
    resume = launch.get("resume")
    if resume:
        load_dir, tag = resume["directory"], resume["tag"]
        _, client = engine.load_checkpoint(load_dir, tag=tag, load_optimizer_states=True,
                                           load_lr_scheduler_states=True)
        if client is None:
            raise RuntimeError(f"DeepSpeed could not load checkpoint {tag} from {load_dir}")
        start_step = int(client["step"])
        rng_file = Path(load_dir) / tag / f"rng_rank{rank}.pt"
        if rng_file.exists() and client.get("world_size") == world:
            checkpoint.set_rng_state(torch.load(rng_file, weights_only=False))  # our own file: python/numpy states

    tokens_per_step = config.train.global_batch_size * config.data.seq_len
    flops = _flops_per_token(model, config, n_params)
    metrics = MetricsLog(run_dir, rank == 0, config.train.max_steps, tokens_per_step, flops, world, device)
    if rank == 0:  # the full plan was printed by `dstrain run` before the ranks started
        metrics.console.print(f"rank 0: {world} ranks up, model {n_params:,} parameters", soft_wrap=True)
        if resume:
            metrics.console.print(f"resumed from {resume['tag']} at step {start_step}")
        metrics.console.print(f"[dim]ready in {time.perf_counter() - started:.1f} s[/]")

    def client_state(step: int) -> dict:
        return {"step": step, "samples_seen": step * config.train.global_batch_size, "world_size": world,
                "config_hash": launch.get("config_hash"), "dstrain_version": launch.get("dstrain_version")}

    # Everything built so far (torch, DeepSpeed, the model, the engine) lives until the end: move it
    # out of the garbage collector's reach, so its periodic full passes stay short (docs/benchmarks.md).
    gc.collect()
    gc.freeze()
    state = train(engine, config, run_dir, train_sampler, eval_sampler, start_step, metrics, device,
                  client_state, stop)
    if config.train.export_final and state.stopped_by is None:
        _export_final(run_dir, state.step, rank, launch)
    dist.barrier()
    return 0


def _seed_everything(seed: int) -> None:
    """Same seed on every rank: identical initial weights (stage 0-2 ranks build the model alone)."""
    import random
    import numpy as np
    import torch
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _enable_activation_checkpointing(model, ds_config: dict, rank: int) -> None:
    import deepspeed
    options = ds_config.get("activation_checkpointing") or {}
    deepspeed.checkpointing.configure(
        None, partition_activations=options.get("partition_activations", False),
        contiguous_checkpointing=options.get("contiguous_memory_optimization", False),
        num_checkpoints=options.get("number_checkpoints"), checkpoint_in_cpu=options.get("cpu_checkpointing", False),
        synchronize=options.get("synchronize_checkpoint_boundary", False), profile=options.get("profile", False))
    if hasattr(model, "enable_checkpointing"):
        model.enable_checkpointing(deepspeed.checkpointing.checkpoint)
    elif rank == 0:
        print("warning: train.activation_checkpointing is on, but the model has no enable_checkpointing(fn) "
              "method; it runs without checkpointing", file=sys.stderr)


def _flops_per_token(model, config, n_params: int) -> float:
    from dstrain.models.gpt import GPT, flops_per_token
    if isinstance(model, GPT):
        embedding = config.model.vocab_size * config.model.d_model + config.data.seq_len * config.model.d_model
        return flops_per_token(n_params, config.model.n_layer, config.model.d_model, config.data.seq_len, embedding)
    return 6.0 * n_params  # a user model: the 6N rule of thumb


def _export_final(run_dir: Path, step: int, rank: int, launch: dict) -> None:
    if rank != 0:
        return
    from dstrain.checkpoint import CHECKPOINTS, tag_for
    from dstrain.convert import convert_checkpoint
    output = run_dir / "final.safetensors"
    convert_checkpoint(run_dir / CHECKPOINTS, output, tag=tag_for(step), force=True,
                       metadata={"config_hash": str(launch.get("config_hash"))})
    print(f"exported consolidated weights to {output}")


def main(argv: list[str]) -> int:
    positional = [a for a in argv if not a.startswith("--")]
    if not positional:
        print("usage: python -m dstrain.worker RUN_DIR (started by `dstrain run`)", file=sys.stderr)
        return 2
    run_dir = Path(positional[0])
    caught, previous_handlers = _catch_stop_signals()  # before the pid is published: `dstrain run` signals it
    record(run_dir, "pid", str(os.getpid()))
    from dstrain.errors import UserError
    try:
        code = run(run_dir, caught, previous_handlers)
        record(run_dir, "exit", "ok")
        return code
    except UserError as err:
        print(f"rank {_rank()}: error: {err}", file=sys.stderr)
        record(run_dir, "exit", f"error: {err}")
        return 2
    except BaseException as err:  # noqa: BLE001 - report which rank failed and why, then fail
        traceback.print_exc()
        print(f"rank {_rank()} failed: {type(err).__name__}: {err}", file=sys.stderr)
        record(run_dir, "exit", "failed: " + "".join(traceback.format_exception_only(type(err), err)).strip())
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
