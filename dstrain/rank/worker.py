"""One rank of a run: `python -m dstrain.rank.worker RUN_DIR`, spawned by the deepspeed launcher.

Everything the rank needs is in RUN_DIR (config.yaml, ds_config.json, launch.json), written by
`dstrain run` before launching; nothing is passed as flags, since the deepspeed runner would
parse abbreviated flags meant for us. Each rank records its pid and how it ended under
RUN_DIR/ranks/, so `dstrain run` can name the rank that failed, and reports its progress there
(dstrain/rank/heartbeat.py) for the hang watchdog.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from dstrain import rundir
from dstrain.rank import heartbeat, output

if __name__ == "__main__" and sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    # Run as a file (DeepSpeed's slurm backend has no -m): dstrain/ itself must not shadow
    # top-level modules, e.g. a user's `models` or `data` named in an entry point.
    sys.path.pop(0)

_IMPORTED = time.perf_counter()  # this module's import: the rank's start-up is measured from here
# Ranks started by mpirun or srun learn RANK only inside deepspeed.init_distributed; the rank
# records written before that read the launcher's own variable.
_RANK_VARIABLES = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK", "SLURM_PROCID")


def _rank() -> int:
    return int(next((os.environ[v] for v in _RANK_VARIABLES if v in os.environ), "0"))


def record(run_dir: Path, name: str, text: str) -> None:
    """Best effort: a full or vanished disk must not turn a rank's report into a second traceback."""
    try:
        directory = run_dir / rundir.RANKS
        directory.mkdir(exist_ok=True)
        (directory / f"rank{_rank()}.{name}").write_text(text)
    except OSError as err:
        # `dstrain run` reads a failure from the exit record; where that cannot be written, say it here
        said = f"; it ends: {text}" if name == "exit" and text != "ok" else ""
        print(f"rank {_rank()}: cannot record {name} under {run_dir / rundir.RANKS}: {err}{said}", file=sys.stderr)


def _catch_stop_signals() -> tuple[list[str], dict]:
    """Note SIGTERM/SIGINT instead of dying until the train loop's handler takes over, so a stop
    request that comes while torch is still importing is not lost. Returns (caught, previous handlers)."""
    caught: list[str] = []

    def note(signum, _frame):
        caught.append(signal.Signals(signum).name)
    return caught, {s: signal.signal(s, note) for s in (signal.SIGTERM, signal.SIGINT)}


_waited_at_gate_s = 0.0  # time spent at the start gate, for the "ready" line


def prepare_while_checks_run() -> None:
    """What every rank does first anyway, done while `dstrain run` still checks: the imports and, on a GPU,
    the CUDA context (not torch._dynamo: dstrain/speedups/dynamo_lazy_import.py). Best effort: a failure
    here shows again, reported, when the rank does the same after the gate."""
    try:
        import torch
        import deepspeed  # noqa: F401
        from dstrain import data, models  # noqa: F401
        from dstrain.rank import checkpointing, loop, metrics  # noqa: F401
        if os.environ.get("DS_ACCELERATOR") == "cuda" and torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            torch.zeros(1, device="cuda")  # creates the context
    except Exception:  # noqa: BLE001
        pass


def _wait_at_start_gate(spec: str, caught: list[str]) -> bool:
    """Ranks started while `dstrain run` still checks (rundir.START_GATE_ENV = "PID:FILE") prepare,
    then wait until FILE says "go". False: leave without touching the run directory (a stop signal
    came, or `dstrain run`, process PID, is gone; after a failed check it kills the ranks itself)."""
    global _waited_at_gate_s
    pid_text, _, path = spec.partition(":")
    gate = Path(path)
    prepare_while_checks_run()
    waiting = time.perf_counter()
    while True:
        try:
            state = gate.read_text().strip()
        except OSError:
            state = ""
        if state == "go":
            _waited_at_gate_s = time.perf_counter() - waiting
            os.environ.pop(rundir.START_GATE_ENV, None)  # not for anything this rank starts
            return True
        if caught or not _alive(int(pid_text)):
            return False
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        pass
    return True


def take_node_settings(env: dict, accelerator: str) -> None:
    """What every node's ranks need in their environment, whatever started them. DeepSpeed takes its
    accelerator from DS_ACCELERATOR when first used (after this). The node that ran `dstrain run` sets it,
    but pdsh, mpirun and srun pass other nodes only some variables, and a node's own environment may say
    otherwise: the run directory decides, the same on every node. Likewise the op cache: without
    TORCH_EXTENSIONS_DIR a node's DeepSpeed builds its ops into torch's shared folder, where another Python
    environment's builds of the same names replace them (each start rebuilds); one the node sets is kept.
    DeepSpeed's questions about the CPU are answered once per machine (op_cache.remember_cpu_info)."""
    from dstrain.op_cache import remember_cpu_info, use_private_op_cache
    env["DS_ACCELERATOR"] = accelerator
    remember_cpu_info(use_private_op_cache(env, accelerator))


def run(run_dir: Path, caught: list[str], previous_handlers: dict) -> int:
    config, ds_config, launch = rundir.read(run_dir)
    take_node_settings(os.environ, launch.accelerator)
    if launch.mode == "eval":  # `dstrain eval`
        for sig in previous_handlers:  # nothing to save: a stop request (SIGINT too) ends it, no traceback
            signal.signal(sig, signal.SIG_DFL)
        if caught:
            signal.raise_signal(signal.Signals[caught[0]])
        from dstrain.rank.evaluation import rank_eval
        return rank_eval(run_dir, config, ds_config, launch)
    from dstrain.rank.loop import StopRequest
    stop = StopRequest()
    stop.install()  # before the slow start-up, so an early SIGTERM is not lost
    if caught:
        stop.signal_name = caught[0]
    return train_rank(run_dir, config, ds_config, launch, stop)


def data_facts(sampler) -> dict:
    """For examples (row formats): how many, in how many rows, and the packing efficiency."""
    efficiency = getattr(sampler, "efficiency", None)
    if efficiency is None:
        return {}
    return {"train_examples": len(sampler.lengths), "train_rows": sampler.size,
            "packed": sampler.packed, "packing_efficiency": efficiency}


def train_rank(run_dir: Path, config, ds_config: dict, launch: rundir.LaunchInfo, stop) -> int:
    """Build the engine, restore the checkpoint to resume, train, export."""
    import torch.distributed as dist

    from dstrain.console_text import outside
    from dstrain.data import build_samplers
    from dstrain.hangs import collective_timeout_s
    from dstrain.models import flops_per_token
    from dstrain.rank.checkpointing import export_final
    from dstrain.rank.loop import LoopParts, train
    from dstrain.rank.metrics import MetricsLog
    from dstrain.rank.runtime import compile_engine, init_rank, quiet_logging, seed_everything

    quiet_logging(launch.verbose)
    rank, world, device = init_rank(collective_timeout_s(launch.hang_timeout_s), ds_config)
    seed_everything(config.train.seed)
    started = time.perf_counter()
    train_sampler, eval_sampler = build_samplers(config)
    data_ready = time.perf_counter()
    engine, model = _build_engine(config, ds_config, device, rank)
    engine_ready = time.perf_counter()
    if config.model.lora is not None and rank == 0:
        _record_lora_layers(run_dir, model)
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    from dstrain.rank.precomputed import attach_reference
    precomputed = attach_reference(engine, config, ds_config, (train_sampler, eval_sampler), device)  # starting weights
    if precomputed and rank == 0:
        print(precomputed, flush=True)
    resume = launch.resume
    restored = _restore(engine, resume, rank, world) if resume else None
    start_step = int(restored["step"]) if restored else 0
    compiled = compile_engine(engine, ds_config, world) if config.train.compile else None

    tokens_per_step = config.train.global_batch_size * config.data.seq_len
    flops = flops_per_token(model, config, n_params)
    trackers = []
    if rank == 0 and config.train.log_to:
        from dstrain.rank.trackers import open_trackers, run_hparams
        trackers = open_trackers(config.train.log_to, run_dir, run_hparams(config, ds_config, world), start_step)
    metrics = MetricsLog(run_dir, rank == 0, config.train.max_steps, tokens_per_step, flops, world, device, trackers)
    if rank == 0:  # the full plan was printed by `dstrain run` before the ranks started
        metrics.console.print(f"rank 0: {world} ranks up, model {n_params:,} parameters", soft_wrap=True)
        facts = data_facts(train_sampler)
        if facts:
            metrics.run_facts.update(facts)
            units = {"lm": "examples", "kto": "examples"}.get(config.train.objective, "pairs")
            metrics.console.print(f"data: {facts['train_examples']:,} {units} in {facts['train_rows']:,} rows of "
                                  f"{config.data.seq_len} tokens ({'packed' if facts['packed'] else 'one per row'}): "
                                  f"packing efficiency {facts['packing_efficiency']:.1%} (real tokens / row tokens)",
                                  soft_wrap=True)
        if resume:
            metrics.console.print(f"resumed from {outside(resume.tag)} at step {start_step}")
        if compiled:  # names the model's block class
            metrics.console.print(outside(compiled), soft_wrap=True)
        now = time.perf_counter()
        gate = f", {_waited_at_gate_s:.1f} s of them waiting for dstrain run's checks" if _waited_at_gate_s >= 0.05 else ""
        metrics.console.print(f"[dim]ready in {now - started:.1f} s (data {data_ready - started:.1f} s, model and "
                              f"engine {engine_ready - data_ready:.1f} s; {started - _IMPORTED:.1f} s of imports and "
                              f"process group before{gate}; {now - _IMPORTED:.1f} s since the rank started)[/]",
                              soft_wrap=True)

    def client_state(step: int) -> dict:
        return {"step": step, "samples_seen": step * config.train.global_batch_size, "world_size": world,
                "config_hash": launch.config_hash, "dstrain_version": launch.dstrain_version}

    # Everything built so far (torch, DeepSpeed, the model, the engine) lives until the end: move it
    # out of the garbage collector's reach, so its periodic full passes stay short (docs/benchmarks.md).
    gc.collect()
    gc.freeze()
    parts = LoopParts.build(engine, config, run_dir, train_sampler, eval_sampler, device, metrics, client_state,
                            restored)
    state = train(engine, config, parts, start_step, stop)
    if config.train.export_final and state.stopped_by is None and rank == 0:
        heartbeat.beat("save")
        export_final(run_dir, state.step, launch, config.train.export_final, config.train.export_dtype)
    dist.barrier()
    return 0


def _build_engine(config, ds_config: dict, device, rank: int):
    """(DeepSpeed engine, the model it wraps), with activation checkpointing as configured."""
    from dstrain.config.resolve import redact
    from dstrain.models import build_model
    from dstrain import speedups
    from dstrain.rank.preference import rng_state, set_up_reference
    from dstrain.rank.runtime import (apply_tiled_mlp, checkpointing_wanted, enable_activation_checkpointing,
                                      initialize_engine, sequence_parallel_mpu)

    policy_rng = rng_state()  # a preference reference copy starts from the same random state
    model = build_model(config, ds_config, device)
    attention = getattr(getattr(getattr(model, "model", None), "config", None), "_attn_implementation", None)
    if attention == "flex_attention" and "attn_implementation" not in config.model.kwargs and rank == 0:
        print("attention: flex_attention for packed rows (auto: its block mask skips the blocks across examples; "
              "model.kwargs.attn_implementation=sdpa to keep sdpa)", flush=True)
    if config.train.precision == "fp8":  # before DeepSpeed hooks the modules and before compiling
        from dstrain.models.fp8 import convert_to_fp8
        converted = convert_to_fp8(model, config.train.fp8_recipe, fast_accum=config.train.fp8_fast_accum)
        if rank == 0:
            print(converted, flush=True)
    tiled = apply_tiled_mlp(model, config)
    if tiled and rank == 0:
        print(tiled, flush=True)
    checkpointing, why = checkpointing_wanted(config, ds_config, model, device)
    if why and rank == 0:
        print(f"activation checkpointing {why} (train.activation_checkpointing=auto; true or false to choose)",
              flush=True)
    if checkpointing:
        enable_activation_checkpointing(model, ds_config, rank)
    if config.train.activation_checkpointing_offload and rank == 0:
        what = ("each checkpointed layer's input kept in pinned host memory until backward" if checkpointing else
                "nothing to offload, activation checkpointing is off on this run (train.activation_checkpointing=auto "
                "decided off)")
        print(f"activation checkpoint offload: {what}", flush=True)
    mpu = sequence_parallel_mpu(model, config, ds_config)
    if mpu is not None and rank == 0:
        sp = config.train.sequence_parallel
        print(f"sequence parallelism: each sequence split over {sp} ranks ({config.data.seq_len // sp} tokens each), "
              f"attention {model.model.config._attn_implementation} through DeepSpeed's Ulysses", flush=True)
    engine = initialize_engine(model, ds_config, config.speedups, mpu)
    engine.config = redact(ds_config)  # DeepSpeed stores this dict in every checkpoint: no API keys there
    report = speedups.apply(engine, config.speedups)
    if rank == 0:
        for line in report.lines():
            print(line, file=sys.stderr if line.startswith("warning:") else sys.stdout, flush=True)
    reference = set_up_reference(model, config, ds_config, device, policy_rng)
    if reference and rank == 0:
        print(reference, flush=True)
    return engine, model


def _record_lora_layers(run_dir: Path, model) -> None:
    """Each LoRA layer's scaling and layout, which `convert-checkpoint --format hf` needs to merge."""
    import json

    from dstrain.models import hf
    rundir.write_atomic(run_dir / rundir.HF_SOURCE / rundir.HF_LORA, json.dumps(hf.lora_layers(model), indent=1))


def _restore(engine, resume: rundir.ResumeTarget, rank: int, world: int) -> dict:
    """Load the checkpoint launch.json names (model, optimizer, scheduler, RNG); returns its client state."""
    from dstrain.rank.checkpointing import load
    return load(engine, resume.directory, resume.tag, rank, world)


def _verbose(run_dir: Path) -> bool:
    """--verbose, from launch.json (read as plain JSON: the rank has not imported pydantic yet)."""
    try:
        return bool(json.loads((run_dir / rundir.LAUNCH).read_text()).get("verbose"))
    except (OSError, ValueError, AttributeError):
        return False


def main(argv: list[str]) -> int:
    positional = [a for a in argv if not a.startswith("--")]
    if not positional:
        print("usage: python -m dstrain.rank.worker RUN_DIR (started by `dstrain run`)", file=sys.stderr)
        return 2
    run_dir = Path(positional[0])
    output.install()  # before torch and DeepSpeed are imported: their known noise goes to the rank log
    caught, previous_handlers = _catch_stop_signals()  # before the pid is published: `dstrain run` signals it
    gate = os.environ.get(rundir.START_GATE_ENV)
    if gate and not _wait_at_start_gate(gate, caught):
        return 0
    record(run_dir, "pid", str(os.getpid()))
    output.open_log(run_dir, _rank(), _verbose(run_dir))
    try:
        heartbeat.start(run_dir, _rank())
    except OSError as err:  # best effort, like the records: no hang detection for this rank
        print(f"rank {_rank()}: cannot write its heartbeat under {run_dir / rundir.RANKS}: {err}", file=sys.stderr)
    from dstrain.errors import UserError
    from dstrain.rank.health import RunUnhealthy
    from dstrain.rank.runtime import close_process_groups
    try:
        code = run(run_dir, caught, previous_handlers)
        close_process_groups()
        record(run_dir, "exit", "ok")
        return code
    except UserError as err:  # `dstrain run` prints it once, from the exit record
        output.write_log_only(f"rank {_rank()}: error: {err}\n")
        record(run_dir, "exit", f"error: {err}")
        return 2
    except RunUnhealthy as err:  # rank 0 has printed the report
        record(run_dir, "exit", err.summary)
        return 1
    except BaseException as err:  # noqa: BLE001 - report which rank failed and why, then fail
        # The traceback goes to the rank log (the console too with --verbose); `dstrain run` prints one
        # message for the run, from the exit record, naming the rank that failed first and this log.
        output.write_log_only(traceback.format_exc() + f"rank {_rank()} failed: {type(err).__name__}: {err}\n")
        record(run_dir, "exit", "failed: " + "".join(traceback.format_exception_only(type(err), err)).strip())
        return 1
    finally:
        heartbeat.finish()


if __name__ == "__main__":
    from dstrain.rank.runtime import exit_without_teardown
    exit_without_teardown(main(sys.argv[1:]))
