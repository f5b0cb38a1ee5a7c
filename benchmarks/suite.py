"""GPU benchmark suite: one model trained the same way by plain torch, DeepSpeed driven by hand, PyTorch
Lightning's DeepSpeed strategies and dstrain, each row a fresh process, on the same batches and initial weights.
docs/benchmarks.md ("How it is measured") says how a row is timed and what its figures mean; benchmarks/calls.sh
runs the calls behind its tables.

Examples:
  python3 benchmarks/suite.py                                      # 406M GPT, 1 GPU, every preset
  python3 benchmarks/suite.py --gpus 2 --presets stage1,stage2,stage3
  python3 benchmarks/suite.py --presets stage1 --variant "compile@torch,deepspeed,dstrain=train.compile=true;+compile"
  python3 benchmarks/suite.py --hf-shape qwen2-1.5b --seq-len 2048 --micro-batch 4 --runners torch,dstrain \
      --presets stage2,stage3 --variant "compiled@torch=+compile_blocks"     # a Hugging Face shape
  python3 benchmarks/suite.py --runners dstrain --presets stage2 --no-base --log-cost   # cost of logging
  python3 benchmarks/suite.py merge A.json B.json -o benchmarks/results/2026-11-22-h100.json
  python3 benchmarks/suite.py --accelerator cpu --n-layer 2 --d-model 64 --n-head 2 --seq-len 32 \
      --vocab-size 256 --micro-batch 2 --steps 6 --log-every 2 --warmup 2    # CPU smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the suite runs from a source checkout, installed or not
sys.path.insert(0, str(REPO / "benchmarks"))  # run_record beside it, also when a test loads this file by path
from run_record import versions  # noqa: E402

_RUNNING: list[int] = []  # the row command in flight, killed with its tree if the suite is stopped

PRESETS = ("stage1", "stage2", "stage2_offload", "stage3", "stage3_offload", "stage3_nvme")
RUNNERS = ("torch", "lightning", "deepspeed", "dstrain")
SLOW = {"stage2_offload": 2, "stage3_offload": 2, "stage3_nvme": 5}  # fewer steps: seconds per step
OFFLOAD = ("stage2_offload", "stage3_offload")

# Hugging Face shapes for --hf-shape: (transformers config class, its arguments). Random weights; only the
# shapes matter for speed (Llama 3.2's rope scaling and the real tokenizers are left out: no effect on it).
HF_SHAPES = {
    "qwen2-1.5b": ("Qwen2Config", dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                                       num_key_value_heads=2, intermediate_size=8960, vocab_size=151936,
                                       tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=32768,
                                       rms_norm_eps=1e-6)),
    "llama-1b": ("LlamaConfig", dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                                     num_key_value_heads=8, intermediate_size=8192, vocab_size=128256,
                                     tie_word_embeddings=True, rope_theta=5e5, max_position_embeddings=131072,
                                     rms_norm_eps=1e-5)),
    # TinyLlama's (docs/fine-tuning.md's throughput table, against Lightning's DeepSpeedStrategy(stage=3))
    "tinyllama-1.1b": ("LlamaConfig", dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                                           num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                                           max_position_embeddings=2048, tie_word_embeddings=False)),
    # CPU smoke tests: vocabulary 256 (the synthetic tokens' default range)
    "tiny-qwen2": ("Qwen2Config", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                       intermediate_size=64, vocab_size=256, tie_word_embeddings=True, rope_theta=1e6,
                                       max_position_embeddings=256)),
    "tiny-llama": ("LlamaConfig", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                       intermediate_size=64, vocab_size=256, tie_word_embeddings=True,
                                       max_position_embeddings=256)),
}


def build_hf_folder(shape: str, root: Path) -> Path:
    """root/shape: a folder AutoModelForCausalLM.from_pretrained loads, random weights in bf16, built once
    (on the GPU where there is one: fast initialisation) and reused while its config matches."""
    import torch
    import transformers
    cls, kwargs = HF_SHAPES[shape]
    config = getattr(transformers, cls)(**kwargs)
    folder = root / shape
    wanted = {k: v for k, v in config.to_dict().items() if k in kwargs}
    if (folder / "config.json").exists() and list(folder.glob("*.safetensors")):
        saved = json.loads((folder / "config.json").read_text())
        if all(saved.get(k) == v for k, v in wanted.items() if k in saved):
            return folder
    tmp = root / f".{shape}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(tmp)
    del model
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


# ------------------------------------------------------------------------------------ rank side

def _to_device(batch, device):
    import torch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    return type(batch)(_to_device(b, device) for b in batch)


def _lr_ratio(update: int, sched: dict) -> float:
    """DeepSpeed's WarmupCosineLR as the engine applies it: update n uses the ratio of iteration
    n - 1 (0 before the first scheduler step), linear warmup then cosine to cos_min_ratio."""
    it = update - 1
    if it < 0:
        return 0.0
    warmup = max(2, sched["warmup_num_steps"])
    if it < warmup:
        return sched["warmup_min_ratio"] + it / warmup * (1.0 - sched["warmup_min_ratio"])
    import math
    progress = min(1.0, (it - warmup + 1) / max(1, sched["total_num_steps"] - warmup))
    return max(0.0, sched["cos_min_ratio"] + (1.0 - sched["cos_min_ratio"]) * (1 + math.cos(math.pi * progress)) / 2)


def _torch_step(config, device, world: int, local_rank: int, compile_model: bool, compile_blocks: bool = False):
    """Plain PyTorch: fp32 weights, autocast bf16, fused AdamW, clipping, DDP when world > 1. An hf: model
    is loaded from its folder as dstrain loads it (fp32 unless model.kwargs.dtype says otherwise);
    compile_blocks: each decoder layer compiled on its own (dstrain's regional compile). With
    train.grad_accum_steps A > 1 a step is A forwards and backwards (DDP's no_sync before the last, as a
    torch user accumulates) and one optimizer step; the micro batch is the same each time (a speed row)."""
    import torch
    from dstrain.models import hf, model_builder
    if hf.is_hf(config.model.name):
        model = hf.build_pretrained(config, {}, device)
    else:
        with torch.device(device):  # built where it trains, as dstrain's build_model does
            model = model_builder(config)()
    if compile_blocks:
        if not isinstance(model, hf.CausalLM):
            raise SystemExit("+compile_blocks compiles an hf: model's decoder layers (--hf-shape or --model hf:...)")
        from dstrain.rank.runtime import compile_hf_blocks
        print(compile_hf_blocks(model, 0), flush=True)
    params = list(model.parameters())
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None,
                    gradient_as_bucket_view=True)
    if compile_model:
        model = torch.compile(model)
    t = config.train
    opt = torch.optim.AdamW(params, lr=t.lr, betas=tuple(t.betas), eps=t.eps, weight_decay=t.weight_decay,
                            fused=device.type == "cuda")
    sched = config.deepspeed["scheduler"]["params"]
    if config.deepspeed["scheduler"]["type"] != "WarmupCosineLR":
        raise SystemExit("the torch runner mirrors WarmupCosineLR only (train.schedule=cosine)")
    bf16 = t.precision == "bf16"
    updates = [0]
    accumulation = t.grad_accum_steps

    def step(batch):
        for group in opt.param_groups:
            group["lr"] = t.lr * _lr_ratio(updates[0], sched)
        for micro in range(accumulation):
            syncing = world == 1 or micro == accumulation - 1
            with contextlib.nullcontext() if syncing else model.no_sync():
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                    loss = model(batch)
                (loss / accumulation if accumulation > 1 else loss).backward()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        updates[0] += 1
        return loss
    return step


def _deepspeed_step(config, ds_config: dict, device):
    """The hand-written DeepSpeed loop, as DeepSpeed's documentation writes it: dstrain's JSON, none of
    dstrain's changes to DeepSpeed's code."""
    import deepspeed
    from dstrain.models import build_model
    from dstrain.rank.runtime import checkpointing_wanted
    model = build_model(config, ds_config, device)
    if checkpointing_wanted(config, ds_config, model, device)[0]:  # as dstrain's rank decides "auto"
        ac = ds_config.get("activation_checkpointing") or {}
        deepspeed.checkpointing.configure(
            None, partition_activations=ac.get("partition_activations", False),
            contiguous_checkpointing=ac.get("contiguous_memory_optimization", False),
            checkpoint_in_cpu=ac.get("cpu_checkpointing", False),
            synchronize=ac.get("synchronize_checkpoint_boundary", False))
        model.enable_checkpointing(deepspeed.checkpointing.checkpoint)
    engine, _, _, _ = deepspeed.initialize(model=model, config=ds_config,
                                           model_parameters=[p for p in model.parameters() if p.requires_grad])
    if config.train.compile:  # as dstrain's worker compiles (DeepCompile's schedule included)
        from dstrain.rank.runtime import compile_engine
        line = compile_engine(engine, ds_config, int(os.environ.get("WORLD_SIZE", "1")))
        if line and int(os.environ.get("RANK", "0")) == 0:
            print(line, flush=True)

    def step(batch):
        loss = engine(batch)
        engine.backward(loss)
        engine.step()
        return loss
    return step


LIGHTNING_STRATEGIES = {"stage1": "deepspeed_stage_1", "stage2": "deepspeed_stage_2",
                        "stage2_offload": "deepspeed_stage_2_offload", "stage3": "deepspeed_stage_3",
                        "stage3_offload": "deepspeed_stage_3_offload"}


def _lightning_fit(config, preset: str, cuda: bool, world: int, log_every: int) -> dict:
    """PyTorch Lightning's named DeepSpeed strategy (`Trainer(strategy="deepspeed_stage_3")`), as a
    user who picks Lightning instead of dstrain would write it: its own DeepSpeed JSON (Lightning's
    defaults), precision="bf16-mixed", gradient_clip_val, torch's AdamW (DeepSpeedCPUAdam where the
    strategy offloads the optimizer, which DeepSpeed requires), the suite's LR schedule as a
    per-step LambdaLR, the model built in configure_model (inside zero.Init for stage 3). Timed
    like the other runners: a callback reads the loss only at the log points."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, Dataset
    from dstrain.data import build_samplers
    from dstrain.data.sampler import rank_batch
    from dstrain.models import model_builder

    t = config.train
    strategy = LIGHTNING_STRATEGIES[preset]
    rank = int(os.environ.get("RANK", "0"))
    sched = config.deepspeed["scheduler"]["params"]
    train_sampler, _ = build_samplers(config)

    class Samples(Dataset):
        """Sample i of this rank: the rows of the micro batch that the other runners train at that step."""
        def __len__(self):
            return t.max_steps * t.micro_batch_size

        def __getitem__(self, index):
            step, row = divmod(index, t.micro_batch_size)
            inputs, targets = rank_batch(train_sampler, step, 0, rank, world, t.micro_batch_size, 1)
            return inputs[row], targets[row]

    class GPTModule(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = None

        def configure_model(self):  # Lightning's hook for zero.Init (stage 3)
            if self.model is None:
                self.model = model_builder(config)()
                from dstrain.rank.runtime import checkpointing_wanted
                device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
                # what dstrain's preset turns on, or its rank decides for "auto" (stage3_offload)
                if checkpointing_wanted(config, config.deepspeed, self.model, device)[0]:
                    import deepspeed
                    deepspeed.checkpointing.configure(None)
                    self.model.enable_checkpointing(deepspeed.checkpointing.checkpoint)

        def training_step(self, batch, _index):
            return self.model(batch)

        def configure_optimizers(self):
            kwargs = dict(lr=t.lr, betas=tuple(t.betas), eps=t.eps, weight_decay=t.weight_decay)
            if "offload" in strategy:
                from deepspeed.ops.adam import DeepSpeedCPUAdam
                opt = DeepSpeedCPUAdam(self.model.parameters(), adamw_mode=True, **kwargs)
            else:
                opt = torch.optim.AdamW(self.model.parameters(), fused=cuda, **kwargs)
            lr = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: _lr_ratio(n, sched))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": lr, "interval": "step"}}

    class Intervals(L.Callback):
        def __init__(self):
            self.intervals, self.start, self.steps = [], None, 0
            self.loss_sum = None

        def on_train_batch_start(self, trainer, module, batch, index):
            if self.start is None:
                self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, index):
            loss = outputs["loss"].detach().float()
            self.loss_sum = loss if self.loss_sum is None else self.loss_sum + loss
            self.steps += 1
            step = index + 1
            if step % log_every == 0 or step == t.max_steps:
                value = trainer.strategy.reduce(self.loss_sum, reduce_op="mean").item() / self.steps
                now = time.perf_counter()
                self.intervals.append({"step": step, "steps": self.steps, "seconds": now - self.start,
                                       "loss": value, "time": time.time()})
                self.start, self.steps, self.loss_sum = time.perf_counter(), 0, None

    timer = Intervals()
    trainer = L.Trainer(accelerator="gpu" if cuda else "cpu", devices=world, num_nodes=1, strategy=strategy,
                        precision="bf16-mixed" if t.precision == "bf16" else "32-true", max_steps=t.max_steps,
                        gradient_clip_val=t.grad_clip or None, callbacks=[timer], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, num_sanity_val_steps=0)
    loader = DataLoader(Samples(), batch_size=t.micro_batch_size, shuffle=False, num_workers=0, pin_memory=cuda)
    trainer.fit(GPTModule(), train_dataloaders=loader)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return {"intervals": timer.intervals, "peak_gpu_gib": peak, "rank": trainer.global_rank}


def worker(spec_path: Path) -> int:
    """One rank of a torch or deepspeed row, started by torch.distributed.run."""
    spec = json.loads(spec_path.read_text())
    import torch
    import torch.distributed as dist
    from dstrain.config.schema import RunConfig
    from dstrain.data import build_samplers
    from dstrain.data.sampler import rank_batch

    config = RunConfig.model_validate(spec["config"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = spec["accelerator"] == "cuda"
    if cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    import random
    import numpy as np
    random.seed(config.train.seed)  # as dstrain's worker seeds: same initial weights everywhere
    np.random.seed(config.train.seed)
    torch.manual_seed(config.train.seed)

    if spec["runner"] == "lightning":  # Lightning starts its own process group and loop
        result = _lightning_fit(config, spec["preset"], cuda, int(os.environ.get("WORLD_SIZE", "1")),
                                config.train.log_every)
        if result.pop("rank") == 0:
            Path(spec["result_path"]).write_text(json.dumps(result))
        return 0
    if spec["runner"] == "torch":
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
        step_fn = _torch_step(config, device, dist.get_world_size(), local_rank, spec.get("torch_compile", False),
                              spec.get("torch_compile_blocks", False))
    else:
        import deepspeed
        if not cuda:  # CPU smoke runs: as dstrain's ranks, not DeepSpeed's shared-memory all-reduce op (built for
            # inference_all_reduce alone; DeepSpeed has no such op on GPUs, so the GPU rows are unchanged)
            from dstrain.rank.runtime import skip_shared_memory_all_reduce_op
            skip_shared_memory_all_reduce_op()
        deepspeed.init_distributed()
        step_fn = _deepspeed_step(config, spec["ds_config"], device)
    rank, world = dist.get_rank(), dist.get_world_size()
    train_sampler, _ = build_samplers(config)
    t = config.train

    # The measured loop: what dstrain's loop does between log points, minus its stop vote.
    intervals = []
    loss_sum = torch.zeros((), device=device)
    start, steps_in = time.perf_counter(), 0
    for step in range(t.max_steps):
        batch = rank_batch(train_sampler, step, 0, rank, world, t.micro_batch_size, 1)
        loss = step_fn(_to_device(batch, device))
        loss_sum += loss.detach().float()
        steps_in += 1
        if (step + 1) % t.log_every == 0 or step + 1 == t.max_steps:
            dist.all_reduce(loss_sum)
            loss_value = loss_sum.item() / (world * steps_in)
            elapsed = time.perf_counter() - start
            intervals.append({"step": step + 1, "steps": steps_in, "seconds": elapsed, "loss": loss_value,
                              "time": time.time()})
            if rank == 0:  # progress in the row's log: a row killed at its timeout still shows its steps
                print(f"interval to step {step + 1}: {steps_in} steps in {elapsed:.3f} s, loss {loss_value:.4f}",
                      flush=True)
            loss_sum.zero_()
            start, steps_in = time.perf_counter(), 0
    peak_gpu = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None

    result = {"intervals": intervals, "peak_gpu_gib": peak_gpu}
    if rank == 0:
        Path(spec["result_path"]).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------------- driver side

def _device_info(accelerator: str) -> tuple[str, str, int]:
    """(name, short name for file names, GPU count), without creating a CUDA context here."""
    if accelerator == "cpu":
        return f"CPU ({os.cpu_count()} cores)", "cpu", 0
    out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, check=True).stdout.strip().splitlines()
    name = out[0].split(",")[0].strip()
    match = re.search(r"([A-Z]\d{2,3}[A-Z]?)\b", name)
    short = (match.group(1) if match else re.sub(r"\W+", "-", name)).lower()
    return f"{len(out)} x {name} ({out[0].split(',')[1].strip()}, driver {out[0].split(',')[2].strip()})", short, len(out)


def _peak(device: str) -> float | None:
    from dstrain.hardware import dense_bf16_peak_tflops
    return dense_bf16_peak_tflops(device)


def _model_info(args) -> dict:
    from dstrain.config.resolve import resolve
    from dstrain.models import count_model
    from dstrain.models import model_builder
    from dstrain.models.gpt import flops_per_token
    config = resolve(None, None, _shape_sets(args, "none", 1), world_size=1, accelerator="cpu", env={}).config
    if args.hf:  # the folder's model, counted on the meta device; FLOPs as dstrain's metrics count them
        from dstrain.models import hf
        built: list = []
        n_params, _ = count_model(lambda: built.append(model_builder(config)()) or built[0])
        hf_config = built[0].model.config
        return {"name": f"hf:{args.hf}", "hf_shape": args.hf_shape, "architecture": type(built[0].model).__name__,
                "n_layer": hf_config.num_hidden_layers, "d_model": hf_config.hidden_size,
                "vocab_size": hf_config.vocab_size, "seq_len": args.seq_len, "micro_batch_per_gpu": args.micro_batch,
                "params": n_params, "flops_per_token": hf.flops_per_token(built[0], n_params, args.seq_len)}
    n_params, _ = count_model(model_builder(config))
    return {"name": "gpt", "n_layer": args.n_layer, "d_model": args.d_model, "n_head": args.n_head,
            "vocab_size": args.vocab_size, "seq_len": args.seq_len, "micro_batch_per_gpu": args.micro_batch,
            "params": n_params, "flops_per_token": flops_per_token(n_params, args.n_layer, args.d_model, args.seq_len, args.vocab_size)}


def _steps(args, preset: str) -> tuple[int, int, int]:
    """(max_steps, log_every, warm-up steps) for a preset: offload presets take fewer, slower steps."""
    div = SLOW.get(preset, 1)
    log_every = max(1, args.log_every // div) if div > 1 else args.log_every
    warmup = max(log_every, args.warmup // div) if div > 1 else args.warmup
    steps = max(warmup + 2 * log_every, args.steps // div)
    return steps, log_every, warmup


def _shape_sets(args, preset: str, gpus: int) -> list[str]:
    steps, log_every, _ = _steps(args, preset)
    model = ([f"model.name=hf:{args.hf}"] if args.hf else  # synthetic tokens stay below model.vocab_size (256)
             [f"model.n_layer={args.n_layer}", f"model.d_model={args.d_model}", f"model.n_head={args.n_head}",
              f"model.vocab_size={args.vocab_size}"])
    sets = [*model, f"data.seq_len={args.seq_len}", "data.source=synthetic",
            f"train.micro_batch_size={args.micro_batch}", f"train.max_steps={steps}", f"train.log_every={log_every}",
            # evaluation only at the end; no checkpoint (writing the optimizer state is not training)
            f"train.eval_every={10**9}", "train.save_checkpoints=false", "train.eval_batches=2"]
    if preset == "stage3_nvme":
        for part in ("offload_param", "offload_optimizer"):
            sets.append(f"deepspeed.zero_optimization.{part}.nvme_path={args.nvme_path}")
        # Each swap buffer must hold the largest parameter: the embedding (vocab x width) here, which is
        # more than the preset's 1e8 elements from a 97k vocabulary at width 1024 on.
        largest = getattr(args, "largest_param", None) or max(args.vocab_size * args.d_model, 4 * args.d_model * args.d_model)
        sets.append(f"deepspeed.zero_optimization.offload_param.buffer_size={max(10**8, -(-largest // 10**6) * 10**6)}")
    return sets + list(args.set or [])


def _rss_and_wait(process: subprocess.Popen, timeout: float, give_up=lambda: False) -> tuple[int | None, float, bool]:
    """Wait for `process` (killing its whole tree after `timeout`, or once give_up() says so); returns (exit
    status, peak RSS of its largest process in GiB, killed). wait4 reports the maximum over the child and
    every descendant it reaped, which is each rank for every launcher used here."""
    deadline = time.monotonic() + timeout
    _RUNNING[:] = [process.pid]
    while True:
        pid, status, usage = os.wait4(process.pid, os.WNOHANG)
        if pid:
            process.returncode = os.waitstatus_to_exitcode(status)
            _RUNNING.clear()
            return process.returncode, usage.ru_maxrss / 2**20, False
        if time.monotonic() > deadline or give_up():
            _kill_tree(process.pid)
            _, status, usage = os.wait4(process.pid, 0)
            process.returncode = os.waitstatus_to_exitcode(status)
            _RUNNING.clear()
            return None, usage.ru_maxrss / 2**20, True
        time.sleep(0.2)


def _timestamped_copy(stream, log, t0: float) -> None:
    """Each output line of a row into its log, prefixed with the seconds since the row's command
    started: where the time before the first step goes (imports, launcher, rank start-up)."""
    for line in stream:
        log.write(f"[{time.time() - t0:7.2f}s] {line}")
        log.flush()


def _kill_tree(pid: int) -> None:
    import psutil
    try:
        procs = psutil.Process(pid).children(recursive=True) + [psutil.Process(pid)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


def _summarise(intervals: list[dict], warmup: int, tokens_per_step: int) -> dict:
    """Median tokens/s over the intervals starting at or after `warmup` steps (all but the first
    interval when the run is too short for that)."""
    rates, start = [], 0
    for iv in intervals:
        iv["tokens_per_s"] = iv.get("tokens_per_s") or tokens_per_step * iv["steps"] / iv["seconds"]
        iv["start"] = start
        start = iv["step"]
    steady = [iv for iv in intervals if iv["start"] >= warmup] or intervals[1:] or intervals
    tokens_per_s = statistics.median(iv["tokens_per_s"] for iv in steady)
    step_s = tokens_per_step / tokens_per_s
    return {"tokens_per_s": tokens_per_s, "step_ms": step_s * 1000, "intervals_used": len(steady),
            "spread": (max(iv["tokens_per_s"] for iv in steady) - min(iv["tokens_per_s"] for iv in steady)) / tokens_per_s,
            "first_interval_end": intervals[0]["time"], "first_interval_steps": intervals[0]["steps"],
            "interval_tokens_per_s": [round(iv["tokens_per_s"]) for iv in intervals],
            "loss_curve": [[iv["step"], round(iv["loss"], 5)] for iv in intervals]}


def _dstrain_intervals(run_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    out, previous = [], 0
    for r in records:
        if "tokens_per_s" in r:
            out.append({"step": r["step"], "steps": r["step"] - previous, "tokens_per_s": r["tokens_per_s"],
                        "seconds": None, "loss": r["loss"], "time": r["time"], "memory_gib": r["memory_gib"]})
            previous = r["step"]
    return out


def _second_half_rate(run_dir: Path, steps: int, tokens_per_step: int) -> float | None:
    """tokens/s from step steps//2 to the last step, from the wall-clock times metrics.jsonl records at
    both (rows that log every step and rows that log only there measure the same window)."""
    times = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line) if line.strip() else {}
        if "tokens_per_s" in r and "event" not in r:
            times[r["step"]] = r["time"]
    half = steps // 2
    if half not in times or steps not in times or times[steps] <= times[half]:
        return None
    return tokens_per_step * (steps - half) / (times[steps] - times[half])


def log_cost_lines(rows: list[dict]) -> list[str]:
    """--log-cost: the throughput a row logging everything every step loses against one logging nothing
    in between, over the same second half of the run."""
    lines = []
    for r in rows:
        if r["runner"] != "dstrain" or r.get("variant") != "log_all" or not r.get("second_half_tokens_per_s"):
            continue
        base = next((b for b in rows if b["runner"] == "dstrain" and b.get("variant") == "log_none"
                     and b["preset"] == r["preset"] and b["gpus"] == r["gpus"] and b.get("second_half_tokens_per_s")), None)
        if base:
            cost = 1 - r["second_half_tokens_per_s"] / base["second_half_tokens_per_s"]
            lines.append(f"log cost {r['preset']} {r['gpus']} GPU: {base['second_half_tokens_per_s']:,.0f} -> "
                         f"{r['second_half_tokens_per_s']:,.0f} tokens/s over steps {r['steps'] // 2}-{r['steps']}: "
                         f"logging every step to metrics.jsonl, TensorBoard and CSV costs {cost:+.2%}")
    return lines


def _only_accumulation(sets: list[str]) -> bool:
    """Whether a row's own settings change nothing but the gradient accumulation (a torch row the offload
    bound can take the GPU's time from)."""
    return all(item.startswith("train.grad_accum_steps=") for item in sets)


def run_row(args, work: Path, runner: str, preset: str, gpus: int, variant: tuple, model: dict) -> dict:
    from dstrain.config.resolve import resolve
    from dstrain.hardware import dense_bf16_peak_tflops
    name, _, extra_sets, flags = variant
    sets = _shape_sets(args, preset, gpus) + extra_sets
    steps, log_every, warmup = _steps(args, preset)
    if "log_half" in flags:  # log (and wait for the device) only at the middle and the end
        sets.append(f"train.log_every={steps // 2}")
    row = {"runner": runner, "preset": preset, "gpus": gpus, "variant": name, "model_name": model["name"],
           "sets": extra_sets + [f"+{f}" for f in flags],
           "tokens_per_s": None, "tflops_per_gpu": None, "peak_gpu_gib": None, "host_rss_gib": None,
           "first_step_s": None, "steps": steps, "log_every": log_every, "warmup_steps": warmup}
    tag = re.sub(r"[^\w.-]+", "_", f"{runner}-{preset}-{gpus}g-{name or 'base'}")
    log_path = work / f"{tag}.log"
    env = dict(os.environ, DS_ACCELERATOR=args.accelerator, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(gpus, 1))))  # as dstrain does
    env.update(f[len("env:"):].split("=", 1) for f in flags if f.startswith("env:") and "=" in f)
    try:
        resolved = resolve(None if preset == "none" else preset, None, sets, world_size=gpus,  # speedups: the row's
                           accelerator=args.accelerator, env={k: v for k, v in env.items() if k.startswith("DSTRAIN_")})
        if args.hf:  # what `dstrain run` adds before its ranks start: at ZeRO-3 each decoder layer one fetch
            from dstrain.launcher.preflight import check_runtime
            check_runtime(resolved)
    except Exception as err:  # noqa: BLE001 - a bad variant is reported in its row
        row["status"] = f"config error: {err}"
        return row
    accumulation = resolved.config.train.grad_accum_steps
    row["grad_accum"] = accumulation
    run_dir = work / tag
    shutil.rmtree(run_dir, ignore_errors=True)
    if runner == "dstrain":
        cmd = [sys.executable, "-m", "dstrain.cli", "run", "--preset", preset, "--gpus", str(gpus),
               "--accelerator", args.accelerator, "--run-dir", str(run_dir)] + [a for s in sets for a in ("--set", s)]
    else:
        spec = {"runner": runner, "preset": preset, "accelerator": args.accelerator, "config": resolved.config.model_dump(mode="json"),
                "ds_config": resolved.ds_config, "result_path": str(work / f"{tag}.result.json"),
                "torch_compile": "compile" in flags, "torch_compile_blocks": "compile_blocks" in flags}
        spec_path = work / f"{tag}.spec.json"
        spec_path.write_text(json.dumps(spec))
        Path(spec["result_path"]).unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={max(gpus, 1)}",
               str(Path(__file__).resolve()), "_worker", str(spec_path)]
    if args.nvme_path and preset == "stage3_nvme":
        shutil.rmtree(args.nvme_path, ignore_errors=True)
        Path(args.nvme_path).mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   start_new_session=True, text=True, errors="replace", bufsize=1)
        copier = threading.Thread(target=_timestamped_copy, args=(process.stdout, log, t0), daemon=True)
        copier.start()
        code, rss, timed_out = _rss_and_wait(process, args.row_timeout)
        copier.join(timeout=10)
    row["wall_s"] = round(time.time() - t0, 1)
    row["host_rss_gib"] = round(rss, 2)
    try:
        if runner == "dstrain":
            intervals = _dstrain_intervals(run_dir)
            row["second_half_tokens_per_s"] = _second_half_rate(run_dir, steps, args.micro_batch * max(gpus, 1)
                                                                * args.seq_len * accumulation)
            row["peak_gpu_gib"] = intervals[-1]["memory_gib"] if args.accelerator == "cuda" and intervals else None
            ds_written = json.loads((run_dir / "ds_config.json").read_text())
            row["ds_config_matches_rendered"] = ds_written == resolved.ds_config
            profiled = run_dir / "profile" / "summary-rank0.txt"  # a row with profile.steps set
            if profiled.is_file():
                row["profile_summary"] = profiled.read_text()
        else:
            result = json.loads(Path(spec["result_path"]).read_text())
            intervals = result["intervals"]
            row["peak_gpu_gib"] = result["peak_gpu_gib"]
        tokens_per_step = args.micro_batch * max(gpus, 1) * args.seq_len * accumulation
        summary = _summarise(intervals, warmup, tokens_per_step)
    except (OSError, KeyError, IndexError, ValueError, statistics.StatisticsError) as err:
        tail = log_path.read_text(errors="replace").splitlines()[-25:] if log_path.exists() else []
        row["status"] = ("timeout" if timed_out else f"failed (exit {code})") + f": {type(err).__name__}: {err}"
        row["log_tail"] = tail
        return row
    row.update({k: summary[k] for k in ("tokens_per_s", "step_ms", "intervals_used", "spread", "loss_curve",
                                        "interval_tokens_per_s")})
    row["tflops_per_gpu"] = summary["tokens_per_s"] * model["flops_per_token"] / max(gpus, 1) / 1e12
    peak = dense_bf16_peak_tflops(args.device_name)
    row["mfu"] = round(row["tflops_per_gpu"] / peak, 4) if peak else None
    row["first_step_s"] = round(summary["first_interval_end"] - t0
                                - (summary["first_interval_steps"] - 1) * summary["step_ms"] / 1000, 2)
    row["status"] = "ok" if code == 0 else ("timeout after the measurement" if timed_out else f"exit {code} after the measurement")
    if row["peak_gpu_gib"] is not None:
        row["peak_gpu_gib"] = round(row["peak_gpu_gib"], 2)
    shutil.rmtree(run_dir, ignore_errors=True)
    return row


def _parse_variant(text: str) -> tuple[str, list[str], list[str], list[str]]:
    """'NAME[@runner,...]=key=value;+flag;...' -> (name, runners, dstrain overrides, suite flags).
    Runners default to deepspeed,dstrain. Flags: +compile (torch runner: torch.compile the model),
    +compile_blocks (torch runner: each decoder layer of an hf: model compiled, as dstrain's train.compile),
    +env:NAME=VALUE (the row's processes get this environment variable, e.g. env:DSTRAIN_OFFLOAD_CHUNKS=off),
    +log_half (dstrain runner: log only at the middle and the end of the run; --log-cost uses it)."""
    head, _, body = text.partition("=")
    name, _, runners = head.partition("@")
    items = [s for s in body.split(";") if s]
    return (name, runners.split(",") if runners else ["deepspeed", "dstrain"],
            [s for s in items if not s.startswith("+")], [s[1:] for s in items if s.startswith("+")])


def _row_key(row: dict) -> tuple:
    return (row["runner"], row["preset"], row["gpus"], row.get("variant", ""))


def add_ratios(rows: list[dict]) -> None:
    """vs_torch and (dstrain rows) vs_deepspeed, against the partner row measured in the same suite
    run (`source`) when there is one: runs on different machines or days differ by more than 2%."""
    measured = [r for r in rows if r.get("tokens_per_s")]

    def partner(key: tuple, source) -> dict | None:
        same = [r for r in measured if _row_key(r) == key]
        return next((r for r in same if r.get("source") == source), same[0] if same else None)
    for r in measured:
        torch_row = partner(("torch", "none", r["gpus"], ""), r.get("source"))
        r["vs_torch"] = round(r["tokens_per_s"] / torch_row["tokens_per_s"], 3) if torch_row else None
        if r["runner"] == "dstrain":
            ds = partner(("deepspeed", r["preset"], r["gpus"], r.get("variant", "")), r.get("source"))
            r["vs_deepspeed"] = round(r["tokens_per_s"] / ds["tokens_per_s"], 3) if ds else None
            pl = partner(("lightning", r["preset"], r["gpus"], ""), r.get("source"))
            r["vs_lightning"] = round(r["tokens_per_s"] / pl["tokens_per_s"], 3) if pl else None


def table(rows: list[dict]) -> str:
    head = ("runner", "preset", "variant", "gpus", "tokens/s", "TFLOP/s/GPU", "MFU", "vs torch", "dstrain/ds",
            "dstrain/pl", "GPU GiB", "RSS GiB", "1st step s", "status")
    lines = [head]
    for r in rows:
        fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
        lines.append((r["runner"], r["preset"], r.get("variant") or "", str(r["gpus"]), fmt(r.get("tokens_per_s"), ",.0f"),
                      fmt(r.get("tflops_per_gpu"), ".1f"), fmt(r.get("mfu"), ".1%"), fmt(r.get("vs_torch"), ".3f"),
                      fmt(r.get("vs_deepspeed"), ".3f"), fmt(r.get("vs_lightning"), ".3f"),
                      fmt(r.get("peak_gpu_gib"), ".2f"), fmt(r.get("host_rss_gib"), ".2f"), fmt(r.get("first_step_s"), ".1f"),
                      (r.get("status") or "")[:60]))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def write_results(path: Path, doc: dict) -> None:
    """Write the results; rows already in the file for other (runner, preset, gpus, variant) stay."""
    if path.exists():
        old = json.loads(path.read_text())
        keys = {_row_key(r) for r in doc["rows"]}
        doc = {**doc, "rows": [r for r in old.get("rows", []) if _row_key(r) not in keys] + doc["rows"]}
    add_ratios(doc["rows"])
    order = ("none",) + PRESETS
    doc["rows"].sort(key=lambda r: (r["gpus"], order.index(r["preset"]) if r["preset"] in order else len(order),
                                    r.get("variant") or "", RUNNERS.index(r["runner"])))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(path)


def merge(files: list[Path], output: Path) -> None:
    """Merge suite result files (later files win for the same runner/preset/gpus/variant); each row
    keeps the name of the file it was measured in as `source`, which pairs rows for the ratios."""
    for f in files:
        doc = json.loads(f.read_text())
        for row in doc["rows"]:
            row.setdefault("source", f.stem)
        write_results(output, doc)
    merged = json.loads(output.read_text())
    merged["parts"] = [{"source": f.stem, "command": json.loads(f.read_text()).get("command")} for f in files]
    merged.pop("command", None)
    output.write_text(json.dumps(merged, indent=1))
    print(table(merged["rows"]))


def _offload_bound_module():
    """benchmarks/offload_bound.py, wherever the suite was loaded from (a script run or a test's import)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("offload_bound", Path(__file__).with_name("offload_bound.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _offload_rates(args, elements: int) -> dict | None:
    """The host's Adam bandwidth and the PCIe rates (benchmarks/offload_bound.py), in a process of their own."""
    env = dict(os.environ, DS_ACCELERATOR=args.accelerator)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("offload_bound.py")), "--elements",
                           str(elements)], capture_output=True, text=True, env=env, cwd=REPO)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        print(f"offload bound: not measured (exit {done.returncode}): {done.stderr.strip()[-500:]}", flush=True)
        return None
    rates = json.loads(lines[-1])
    pcie = (f"PCIe {rates['h2d_gb_s']:.1f} GB/s to the GPU, {rates['d2h_gb_s']:.1f} GB/s back (pinned)"
            if rates.get("h2d_gb_s") else "no GPU: PCIe not measured")
    print(f"offload bound: host Adam {rates['adam_gb_s']:.1f} GB/s ({rates['adam_op']}, {rates['threads']} threads, "
          f"{elements:,} elements); {pcie}", flush=True)
    return rates


def main(argv: list[str]) -> int:
    if argv[:1] == ["_worker"]:
        return worker(Path(argv[1]))
    if argv[:1] == ["_build_hf"]:
        print(f"Hugging Face folder: {build_hf_folder(argv[1], Path(argv[2]))}", flush=True)
        return 0
    if argv[:1] == ["merge"]:
        p = argparse.ArgumentParser(prog="suite.py merge")
        p.add_argument("files", nargs="+", type=Path)
        p.add_argument("-o", "--output", type=Path, required=True)
        a = p.parse_args(argv[1:])
        merge(a.files, a.output)
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--presets", default=",".join(PRESETS), help="comma-separated dstrain presets")
    p.add_argument("--runners", default=",".join(RUNNERS),
                   help="comma-separated: torch, lightning, deepspeed, dstrain (lightning: CUDA only)")
    p.add_argument("--gpus", default="1", help="comma-separated GPU counts, e.g. 1,2")
    p.add_argument("--accelerator", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--n-layer", type=int, default=24)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--n-head", type=int, default=16)
    p.add_argument("--vocab-size", type=int, default=100352, help="100352 makes the default GPT 406M parameters")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per GPU per step")
    p.add_argument("--hf-shape", choices=sorted(HF_SHAPES), default=None,
                   help="train a Hugging Face model of this shape (random weights, built once into --hf-dir) "
                        "instead of the built-in GPT; --n-layer, --d-model, --n-head and --vocab-size do not apply")
    p.add_argument("--hf-dir", type=Path, default=Path.home() / ".cache" / "dstrain" / "bench-hf",
                   help="where --hf-shape folders are built and kept")
    p.add_argument("--model", default="gpt", help="gpt, or hf:FOLDER (a saved Hugging Face causal LM)")
    p.add_argument("--no-offload-bound", dest="offload_bound", action="store_false",
                   help="skip measuring the host's Adam bandwidth and PCIe rates for the offload rows' bound")
    p.add_argument("--bound-elements", type=int, default=1 << 28,
                   help="elements of the Adam partition timed for the offload bound (default 268M, 4.3 GiB of states)")
    p.add_argument("--steps", type=int, default=60,
                   help="steps per row (offload presets: 1/2, NVMe: 1/5); host-bound rows vary by 10%% "
                        "between intervals, so fewer than ~10 measured intervals give noisy ratios")
    p.add_argument("--log-every", type=int, default=5, help="steps per timing interval")
    p.add_argument("--warmup", type=int, default=10, help="steps excluded from the median")
    p.add_argument("--set", action="append", help="extra dstrain override for every row, e.g. train.lr=3e-4")
    p.add_argument("--variant", action="append", default=[],
                   help="'NAME[@runners]=key=value;+flag': extra rows with these dstrain overrides (runners: "
                        "deepspeed,dstrain unless named); flags +compile, +compile_blocks (torch), +env:NAME=VALUE")
    p.add_argument("--no-base", action="store_true", help="run only the --variant rows")
    p.add_argument("--log-cost", action="store_true",
                   help="add two dstrain rows per preset: log_all (train.log_every=1, train.log_to=[tensorboard,csv]) "
                        "and log_none (logging only at the middle and the end), compared over the second half")
    p.add_argument("--nvme-path", default=str(Path(tempfile.gettempdir()) / "dstrain-bench-nvme"))
    p.add_argument("--row-timeout", type=float, default=600.0, help="seconds before a row is killed")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    p.add_argument("--work", type=Path, default=None, help="logs and run directories (default: a temp dir)")
    args = p.parse_args(argv)

    def stop(signum, _frame):  # rows run in their own sessions: take the one in flight down too
        for pid in _RUNNING:
            _kill_tree(pid)
        sys.exit(128 + signum)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    device, short, count = _device_info(args.accelerator)
    args.device_name = device
    if args.hf_shape and args.model != "gpt":
        p.error("--hf-shape and --model name the model twice: give one")
    if args.model != "gpt" and not args.model.startswith("hf:"):
        p.error("--model takes gpt or hf:FOLDER")
    if args.hf_shape:  # in a process of its own: the driver holds no CUDA context while the rows run
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "_build_hf", args.hf_shape, str(args.hf_dir)],
                       check=True, env=env, cwd=REPO)
    args.hf = (str(args.hf_dir / args.hf_shape) if args.hf_shape
               else args.model[len("hf:"):] if args.model.startswith("hf:") else None)
    gpu_counts = [int(g) for g in args.gpus.split(",")]
    runners = args.runners.split(",")
    presets = [x for x in args.presets.split(",") if x]
    variants = [_parse_variant(v) for v in args.variant]
    if args.log_cost:
        variants += [("log_none", ["dstrain"], [], ["log_half"]),
                     ("log_all", ["dstrain"], ["train.log_every=1", "train.log_to=[tensorboard,csv]"], [])]
    work = args.work or Path(tempfile.mkdtemp(prefix="dstrain-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    model = _model_info(args)
    if args.hf:  # the embedding: an hf: model's largest parameter, which stage3_nvme's swap buffers must hold
        args.largest_param = model["vocab_size"] * model["d_model"]
    suffix = f"x{max(gpu_counts)}" if max(gpu_counts) > 1 else ""
    out_path = args.out / f"{datetime.date.today().isoformat()}-{short}{suffix}.json"
    doc = {"device": device, "versions": versions(), "model": model, "rows": [],
           "method": "median tokens/s over log intervals after warm-up; TFLOP/s = tokens/s x flops_per_token / GPUs; "
                     "MFU = TFLOP/s per GPU / the GPU's dense bf16 peak (dstrain.hardware.dense_bf16_peak_tflops)",
           "peak_tflops": None if args.accelerator == "cpu" else _peak(device),
           "command": "python3 benchmarks/suite.py " + " ".join(argv)}
    print(f"{device}; model {model['name']} {model['params']:,} params, {model['flops_per_token'] / 1e9:.3f} "
          f"GFLOP/token; results -> {out_path}; logs -> {work}", flush=True)
    rates = None
    if args.offload_bound and any(r in runners for r in RUNNERS[1:]) and any(x in OFFLOAD for x in presets):
        rates = _offload_rates(args, min(args.bound_elements, model["params"]))
        doc["offload_rates"] = rates
    # (GPUs, accumulation) -> the step time of a torch row that changes nothing else: the GPU's part of the bound
    torch_step_s: dict[tuple[int, int], float] = {}
    if out_path.exists():  # an earlier invocation of this call (same machine, same file) may have run torch
        for r in json.loads(out_path.read_text()).get("rows", []):
            if r["runner"] == "torch" and r.get("step_ms") and r.get("model_name") == model["name"] \
                    and _only_accumulation(r.get("sets", [])):
                torch_step_s[(r["gpus"], r.get("grad_accum", 1))] = r["step_ms"] / 1000

    plan = []
    base = [] if args.no_base else [("", list(RUNNERS), [], [])]
    for gpus in gpu_counts:
        plan += [("torch", "none", gpus, v) for v in base + variants if "torch" in runners and "torch" in v[1]]
        for preset in presets:
            plan += [(r, preset, gpus, v) for v in base + variants for r in RUNNERS[1:]
                     if r in runners and r in v[1]]
    for runner, preset, gpus, variant in plan:
        if args.accelerator == "cuda" and gpus > count:
            print(f"skip {runner} {preset} on {gpus} GPUs: this machine has {count}")
            continue
        if runner == "lightning" and (args.accelerator != "cuda" or preset not in LIGHTNING_STRATEGIES):
            print(f"skip lightning {preset}: Lightning's DeepSpeed strategies run on CUDA only, and the "
                  f"suite mirrors {', '.join(LIGHTNING_STRATEGIES)}")
            continue
        row = run_row(args, work, runner, preset, gpus, variant, model)
        write_results(out_path, {**doc, "rows": [row]})  # after every row: a killed suite keeps what it measured
        rate = row.get("tokens_per_s")
        print(f"{runner:9} {preset:14} {variant[0] or 'base':12} {gpus} GPU  "
              + (f"{rate:,.0f} tok/s  {row['tflops_per_gpu']:.1f} TFLOP/s  step {row['step_ms']:.1f} ms "
                 f"(spread {row['spread']:.1%})  GPU {row['peak_gpu_gib']} GiB  RSS {row['host_rss_gib']} GiB  "
                 f"first step {row['first_step_s']} s  wall {row['wall_s']} s  {row['status']}"
                 if rate else f"{row['status']}" + "".join("\n    | " + line for line in row.get("log_tail", []))), flush=True)
        if runner == "torch" and rate and _only_accumulation(row["sets"]):
            torch_step_s[(gpus, row["grad_accum"])] = row["step_ms"] / 1000
        if rates and rates.get("adam_gb_s") and preset in OFFLOAD and rate:
            bound, bound_line = _offload_bound_module().bound, _offload_bound_module().bound_line
            # torch at the row's accumulation where it ran, else its step a batch
            peer = (row["grad_accum"] if (gpus, row["grad_accum"]) in torch_step_s else 1)
            parts = bound(preset, model["params"], row["grad_accum"], rates, torch_step_s.get((gpus, peer)), peer)
            row["offload_bound"] = {**parts,  # seconds a step
                                    "fraction": round(parts["bound_s"] / (row["step_ms"] / 1000), 3)}
            write_results(out_path, {**doc, "rows": [row]})
            print(bound_line(row, parts), flush=True)
    final = json.loads(out_path.read_text())
    print("\n" + table(final["rows"]))
    for line in log_cost_lines(final["rows"]):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
