"""GPU benchmark: long sequences with and without sequence parallelism, dstrain against its peers, on a ~1.1B
Llama (TinyLlama's shape, random weights, made once in --model-dir; --tiny: a 4-layer one for CPU smoke tests).
docs/long-context.md shows the tables and the commands behind them.

Runners, each row a fresh process (ZeRO-3, bf16, activation checkpointing, micro batch 1, random tokens, no
checkpoints):
  dstrain     `dstrain run` with train.sequence_parallel = the split; --variants adds the long-sequence memory
              switches (VARIANTS: "default" is dstrain's own choices)
  trl         TRL's SFTTrainer, `accelerate launch` with a DeepSpeed ZeRO-3 JSON and Accelerate's sequence
              parallelism on DeepSpeed's backend (ParallelismConfig(sp_backend="deepspeed"), accelerate >= 1.12)
  accelerate  a plain Accelerate loop with the same (as accelerate's own ALST test writes it)
Layouts: for every GPU count N, "dp" (each GPU its own sequences) and, for N > 1, "sp" (each sequence split over
the N GPUs), at every --seq-lens length; then (unless --no-max) the longest that trains: doubling from --max-from
until a run fails or passes --max-to. Per row: tokens/s of the whole job (median over the --log-every intervals
after --warmup steps), TFLOP/s and MFU with dstrain's formula, the peak GPU memory of rank 0; a peer that cannot
run gets its reason. --json writes every row as it comes, with the date, the GPU and the versions.

    python3 benchmarks/long_context.py --model-dir /tmp/llama-1b --gpus 2 --seq-lens 4096,32768 --no-max
    python3 benchmarks/long_context.py --model-dir /tmp/llama-1b --gpus 1 --seq-lens 32768 --variants off,tiled
    python3 benchmarks/long_context.py --model-dir /tmp/llama-1b --runners dstrain,trl,accelerate --gpus 2 \
        --layouts sp --seq-lens 32768 --no-max
    python3 benchmarks/long_context.py --accelerator cpu --tiny --gpus 2 --seq-lens 64 --no-max --steps 3 \
        --log-every 1 --warmup 1                                            # CPU smoke test (minutes)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from run_record import LLAMA_1B, REPO, dstrain_command, install_trl, metrics, reuse_or_make_llama, write_json

RUNNERS = ("dstrain", "trl", "accelerate")
PEERS = RUNNERS[1:]
# The versions that first shipped DeepSpeed sequence parallelism (accelerate's own checks and TRL's docs)
MIN_ACCELERATE = "1.12.0"
MIN_DEEPSPEED = "0.18.2"
# --variants: the long-sequence memory switches each dstrain run gets (docs/long-context.md)
VARIANTS = {
    "default": [],
    "off": ["train.tiled_mlp=false"],
    "tiled": ["train.tiled_mlp=true"],
    "offload": ["train.tiled_mlp=false", "train.activation_checkpointing_offload=true"],
    "tiled+offload": ["train.tiled_mlp=true", "train.activation_checkpointing_offload=true"],
}
# Out of memory, as the rank reports it: torch on the GPU, or the kernel's OOM killer on CPU ranks
OOM_SIGNS = ("CUDA out of memory", "OutOfMemoryError", "out of memory", "exit -9", "signal 9", "SIGKILL")


def make_tiny(directory: Path) -> None:
    """A 4-layer Llama of width 64 (4 heads, 2 key-value heads): for the CPU smoke test."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)


# ------------------------------------------------------------------ pure parts (tested without a launcher)


def peer_missing(peer: str) -> str | None:
    """Why `peer` cannot run sequence parallelism here, or None when it can."""
    import importlib.metadata as md
    from packaging.version import Version
    needs = {"accelerate": MIN_ACCELERATE, "deepspeed": MIN_DEEPSPEED}
    if peer == "trl":
        needs.update(trl="0", datasets="0")
    for package, least in needs.items():
        try:
            found = md.version(package)
        except md.PackageNotFoundError:
            return f"{package} is not installed"
        if Version(found) < Version(least):
            return f"{package} {found} is older than {least}, the first with DeepSpeed sequence parallelism"
    try:  # installed is not importable: datasets needs pyarrow, xxhash, ... which --no-deps wheels do not bring
        from accelerate.utils import ParallelismConfig  # noqa: F401
        from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig  # noqa: F401
        if peer == "trl":
            import datasets  # noqa: F401
            from trl import SFTConfig, SFTTrainer  # noqa: F401
    except Exception as err:  # noqa: BLE001 - any import failure is the row's reason
        return f"import failed: {type(err).__name__}: {err}"[:300]
    return None


def deepspeed_config(accelerator: str, train_batch_size: int | str = "auto") -> dict:
    """ZeRO-3, micro batch 1, no accumulation. train_batch_size: "auto" for Trainer (which fills it in), the
    number of processes for a plain Accelerate loop (which leaves "auto" as it is, and zero.Init checks it
    against the world size); under SP Accelerate's prepare sets micro x accumulation x data-parallel size."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": train_batch_size,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": accelerator == "cuda"},  # the CPU smoke test runs fp32, as dstrain's does
        "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True},
        # TRL's alst_ulysses example config: the all-to-all in bf16
        "seq_parallel_communication_data_type": "bf16" if accelerator == "cuda" else "fp32",
        "steps_per_print": 1000000,
        "wall_clock_breakdown": False,
    }


def accelerate_config(gpus: int, sp: int, ds_config_path: str, accelerator: str, attn: str) -> dict:
    """The `accelerate launch --config_file` contents (accelerate's sequence_parallelism guide's YAML shape).
    bf16 and the batch sizes live in the DeepSpeed file only: accelerate refuses them in both places."""
    config = {
        "compute_environment": "LOCAL_MACHINE", "distributed_type": "DEEPSPEED",
        "deepspeed_config": {"deepspeed_config_file": ds_config_path, "zero3_init_flag": True},
        "num_machines": 1, "machine_rank": 0, "num_processes": gpus, "rdzv_backend": "static",
        "same_network": True, "use_cpu": accelerator == "cpu", "main_training_function": "main",
    }
    if sp > 1:
        config["parallelism_config"] = {
            "parallelism_config_dp_replicate_size": 1, "parallelism_config_dp_shard_size": gpus // sp,
            "parallelism_config_tp_size": 1, "parallelism_config_cp_size": 1,
            "parallelism_config_sp_size": sp, "parallelism_config_sp_backend": "deepspeed",
            "parallelism_config_sp_seq_length_is_variable": True,
            "parallelism_config_sp_attn_implementation": attn,
        }
    return config


def tokens_per_s(stamps: list[float], seq_len: int, sequences_per_step: int, warmup: int, every: int) -> list[float]:
    """Tokens/s of each `every`-step interval after `warmup` steps; stamps[i] = time at the end of step i
    (stamps[0]: the start of step 1)."""
    rates = []
    for start in range(warmup, len(stamps) - every, every):
        elapsed = stamps[start + every] - stamps[start]
        rates.append(every * sequences_per_step * seq_len / max(elapsed, 1e-9))
    return rates


def model_flops_per_token(model_dir: Path, seq_len: int) -> float:
    """dstrain's FLOPs per token for the folder's model (built on the meta device: no weights read)."""
    import types
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from dstrain.models.hf import flops_per_token
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    n_params = sum(p.numel() for p in model.parameters())
    return flops_per_token(types.SimpleNamespace(model=model), n_params, seq_len)


def add_mfu(row: dict, flops_per_token: float, device_name: str) -> None:
    """tflops_per_device and mfu as dstrain's metrics compute them (recomputation not counted)."""
    from dstrain.hardware import dense_bf16_peak_tflops
    if row.get("tokens_per_s"):
        row["tflops_per_device"] = row["tokens_per_s"] * flops_per_token / row["gpus"] / 1e12
        peak = dense_bf16_peak_tflops(device_name)
        if peak:
            row["mfu"] = row["tflops_per_device"] / peak


def describe(row: dict) -> str:
    layout = f"SP {row['sequence_parallel']}" if row["sequence_parallel"] > 1 else "DP"
    length = f"{row['seq_len']:,}"
    if row.get("search") == "max":
        length = f"max {row['max_seq_len']:,}" if row.get("max_seq_len") else "none fits"
    speed = f"{row['tokens_per_s']:,.0f}" if row.get("tokens_per_s") else ""
    mfu = f"{row['mfu']:.1%}" if row.get("mfu") is not None else ""
    memory = f"{row['peak_memory_gib']:.1f}" if row.get("peak_memory_gib") is not None else ""
    status = "" if row.get("status") == "ok" else row.get("status", "")
    line = (f"{row['gpus']:>4} {layout:>6} {row['runner']:>10} {row.get('variant', ''):>13} {length:>12} {speed:>10} "
            f"{mfu:>6} {memory:>9} {status:>11}")
    if row.get("reason"):
        line += f"  {row['reason']}"
    return line


HEADER = (f"{'GPUs':>4} {'layout':>6} {'runner':>10} {'variant':>13} {'seq_len':>12} {'tokens/s':>10} {'MFU':>6} "
          f"{'peak GiB':>9} {'status':>11}")


def layouts(args) -> list[tuple[int, int]]:
    """(GPUs, sequence-parallel size) of every row."""
    wanted = set(args.layouts.split(","))
    counts = [int(g) for g in args.gpus.split(",") if g]
    return [(g, sp) for g in counts for sp in ((1, g) if g > 1 else (1,)) if ("sp" if sp > 1 else "dp") in wanted]


# ------------------------------------------------------------------ parent: one process per row


def dstrain_row(model_dir: Path, gpus: int, sp: int, seq_len: int, args, variant: str) -> dict:
    """One `dstrain run`; the row's figures, or its status ("oom", "failed") and the output's end."""
    row = {"runner": "dstrain", "gpus": gpus, "sequence_parallel": sp, "seq_len": seq_len, "variant": variant}
    with tempfile.TemporaryDirectory() as scratch:
        run_dir = Path(scratch) / "run"
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]  # synthetic ids below it
        sets = [f"model.name=hf:{model_dir}", "data.source=synthetic", f"model.vocab_size={vocab}",
                f"model.kwargs.max_position_embeddings={max(seq_len, 2048)}", f"data.seq_len={seq_len}",
                "train.micro_batch_size=1", f"train.max_steps={args.steps}", f"train.log_every={args.log_every}",
                "train.save_checkpoints=false", "train.eval_every=1000000", "train.eval_batches=1",
                "train.warmup_steps=2", "train.lr=1e-5", "train.activation_checkpointing=true",
                f"train.sequence_parallel={sp}", *VARIANTS[variant], *(args.set or [])]
        started = time.perf_counter()
        done = subprocess.run(dstrain_command(args.preset, gpus, args.accelerator, run_dir, sets), cwd=REPO,
                              capture_output=True, text=True, timeout=args.timeout)
        row["wall_s"] = round(time.perf_counter() - started, 1)
        output = done.stdout + done.stderr
        if done.returncode:
            return dict(row, status="oom" if any(sign in output for sign in OOM_SIGNS) else "failed",
                        reason=last_error(output), error=output[-2000:])
        steps = [r for r in metrics(run_dir) if "tokens_per_s" in r]
    timed = [r for r in steps if r["step"] - args.log_every >= args.warmup] or steps[-1:]
    row.update(status="ok", tokens_per_s=statistics.median(r["tokens_per_s"] for r in timed), intervals=len(timed),
               first_loss=steps[0]["loss"], last_loss=steps[-1]["loss"],
               peak_memory_gib=max((r["memory_gib"] for r in steps if "memory_gib" in r), default=None))
    for key in ("tflops_per_device", "mfu"):
        values = [r[key] for r in timed if key in r]
        if values:
            row[key] = statistics.median(values)
    return row


def peer_row(peer: str, model_dir: Path, gpus: int, sp: int, seq_len: int, args) -> dict:
    """One `accelerate launch` of this file's worker: TRL's SFTTrainer or a plain Accelerate loop."""
    row = {"runner": peer, "gpus": gpus, "sequence_parallel": sp, "seq_len": seq_len}
    missing = peer_missing(peer)
    if missing:
        return dict(row, status="unavailable", reason=missing)
    launcher = shutil.which("accelerate")
    if launcher is None:
        return dict(row, status="unavailable", reason="no `accelerate` command on PATH")
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        (scratch / "ds.json").write_text(json.dumps(
            deepspeed_config(args.accelerator, "auto" if peer == "trl" else gpus)))
        # JSON is what accelerate's load_config_from_file reads for a .json name
        (scratch / "accelerate.json").write_text(json.dumps(
            accelerate_config(gpus, sp, str(scratch / "ds.json"), args.accelerator, args.attn)))
        command = [launcher, "launch", "--config_file", str(scratch / "accelerate.json"), "--main_process_port",
                   str(args.port), __file__, "--worker", peer, "--model-dir", str(model_dir), "--seq-len", str(seq_len),
                   "--sp", str(sp), "--steps", str(args.steps), "--attn", args.attn, "--accelerator", args.accelerator,
                   "--out", str(scratch / "result.json")]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                   TOKENIZERS_PARALLELISM="false")
        started = time.perf_counter()
        try:
            done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=args.timeout, env=env)
        except subprocess.TimeoutExpired:
            return dict(row, status="timeout", reason=f"over {args.timeout:.0f} s")
        row["wall_s"] = round(time.perf_counter() - started, 1)
        output = done.stdout + done.stderr
        if done.returncode or not (scratch / "result.json").is_file():
            row["status"] = "oom" if any(sign in output for sign in OOM_SIGNS) else "failed"
            row["reason"] = last_error(output)
            row["error"] = output[-3000:]
            return row
        result = json.loads((scratch / "result.json").read_text())
    rates = tokens_per_s(result["stamps"], seq_len, gpus // sp, args.warmup, args.log_every)
    row.update(status="ok", tokens_per_s=statistics.median(rates) if rates else None, intervals=len(rates),
               first_loss=result["losses"][0] if result["losses"] else None,
               last_loss=result["losses"][-1] if result["losses"] else None,
               peak_memory_gib=result["peak_memory_gib"], shard_len=result["shard_len"], versions=result["versions"])
    add_mfu(row, model_flops_per_token(model_dir, seq_len), result["device"])
    return row


def last_error(output: str) -> str:
    """The last line that names an exception: the row's reason, short enough for the table."""
    lines = [line.strip() for line in output.splitlines()
             if ("Error" in line or "error:" in line) and "ChildFailedError" not in line and "elastic" not in line]
    return (lines[-1] if lines else output.strip().splitlines()[-1] if output.strip() else "no output")[:300]


# ------------------------------------------------------------------ worker: runs on every rank of a peer's row


def worker(args) -> None:
    import importlib.metadata as md
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, TrainerCallback

    cuda = args.accelerator == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    vocab = json.loads((args.model_dir / "config.json").read_text())["vocab_size"]
    stamps: list[float] = []

    def stamp() -> None:  # the device's work finished: the step's time is its own
        if cuda:
            torch.cuda.synchronize()
        stamps.append(time.perf_counter())

    def sequences(count: int) -> list[list[int]]:
        generator = torch.Generator().manual_seed(0)
        return torch.randint(0, vocab, (count, args.seq_len), generator=generator).tolist()

    shard: list[int] = []

    def watch(model) -> None:  # the length the first forward sees: seq_len / sp when the split is on
        def first(_module, positional, named):
            ids = named.get("input_ids") if named.get("input_ids") is not None else positional[0]
            if not shard:
                shard.append(ids.shape[-1])
        model.register_forward_pre_hook(first, with_kwargs=True)

    losses: list[float] = []
    if args.worker == "trl":
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        parallelism = parallelism_config(args)  # also in the accelerate config; passed here as TRL's docs show
        config = SFTConfig(
            output_dir=str(Path(args.out).parent / "trainer"), max_steps=args.steps, per_device_train_batch_size=1,
            gradient_accumulation_steps=1, learning_rate=1e-5, warmup_steps=2, lr_scheduler_type="linear",
            bf16=cuda, gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
            logging_steps=1, save_strategy="no", report_to="none", max_length=args.seq_len, packing=False,
            pad_to_multiple_of=args.sp if args.sp > 1 else None, parallelism_config=parallelism,
            dataloader_num_workers=0, use_cpu=not cuda, seed=0, model_init_kwargs=None)
        # Loaded after SFTConfig: under ZeRO-3 its DeepSpeed config makes from_pretrained partition at load
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype, attn_implementation=args.attn)
        watch(model)

        class Stamps(TrainerCallback):
            def on_step_begin(self, _args, state, control, **kwargs):
                if not stamps:
                    stamp()

            def on_step_end(self, _args, state, control, **kwargs):
                stamp()

        trainer = SFTTrainer(model=model, args=config, processing_class=tiny_tokenizer(),
                             train_dataset=Dataset.from_dict({"input_ids": sequences((args.steps + 2) * world_size())}),
                             callbacks=[Stamps()])
        trainer.train()
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    else:
        losses = accelerate_loop(args, dtype, sequences, stamp, watch)

    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        Path(args.out).write_text(json.dumps({
            "stamps": stamps, "losses": losses, "shard_len": shard[0] if shard else None,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "device": torch.cuda.get_device_name(0) if cuda else "cpu",
            "versions": {p: md.version(p) for p in ("accelerate", "trl", "transformers", "deepspeed", "torch")
                         if _installed(p)}}))


def accelerate_loop(args, dtype, sequences, stamp, watch) -> list[float]:
    """accelerate's ALST test's loop: the SP dataloader adapter adds shift_labels; each rank's share of the
    loss is weighted by its counted tokens over the SP group (differentiable all_gather)."""
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    accelerator = Accelerator(parallelism_config=parallelism_config(args))
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype, attn_implementation=args.attn)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    watch(model)
    ids = torch.tensor(sequences((args.steps + 2) * world_size()))
    positions = torch.arange(args.seq_len).expand_as(ids)

    def collate(batch):
        rows = torch.stack([b[0] for b in batch])
        return {"input_ids": rows, "position_ids": torch.stack([b[1] for b in batch]), "labels": rows.clone()}

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids, positions), batch_size=1,
                                         collate_fn=collate)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    group = None
    if args.sp > 1:
        from deepspeed.utils import groups
        group = groups._get_sequence_parallel_group()
    losses = []
    model.train()
    for step, batch in enumerate(loader):
        if step == args.steps:
            break
        if step == 0:
            stamp()
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        if "labels" not in batch:  # the SP adapter leaves shift_labels only; as transformers' Trainer does
            batch["labels"] = batch["shift_labels"]
        loss = model(**batch).loss
        if group is not None:
            counted = (batch["shift_labels"] != -100).sum()
            shares = torch.distributed.nn.functional.all_gather(loss * counted, group=group)
            totals = torch.distributed.nn.functional.all_gather(counted, group=group)
            loss = sum(shares) / max(sum(totals), 1)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        stamp()
    accelerator.end_training()
    return losses


def parallelism_config(args):
    """Accelerate's sequence parallelism on DeepSpeed's backend (None without the split)."""
    from accelerate.utils import ParallelismConfig
    from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig
    if args.sp == 1:
        return None
    return ParallelismConfig(sp_backend="deepspeed", sp_size=args.sp, dp_shard_size=world_size() // args.sp,
                             sp_handler=DeepSpeedSequenceParallelConfig(
                                 sp_seq_length=args.seq_len, sp_seq_length_is_variable=True,
                                 sp_attn_implementation=args.attn))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def tiny_tokenizer():
    """SFTTrainer wants a processing class for its pad token; the random-weight folder has no tokenizer and
    the ids are synthetic, so a two-word one is enough."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"<pad>": 0, "<eos>": 1}, unk_token="<pad>")),
                                   pad_token="<pad>", eos_token="<eos>")


def _installed(package: str) -> bool:
    import importlib.metadata as md
    try:
        md.version(package)
        return True
    except md.PackageNotFoundError:
        return False


# ------------------------------------------------------------------ main


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runners", default="dstrain", help=f"comma-separated: {', '.join(RUNNERS)}")
    parser.add_argument("--gpus", default="1,2,4", help="comma-separated GPU counts (those above this machine's skipped)")
    parser.add_argument("--layouts", default="dp,sp", help="dp (each GPU its own sequences), sp (each sequence split), or both")
    parser.add_argument("--variants", default="default",
                        help=f"dstrain rows: comma-separated memory-switch variants, of {', '.join(VARIANTS)}")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="the hf model folder: made there when it holds none, reused when it does (default: a temp dir)")
    parser.add_argument("--tiny", action="store_true", help="a tiny Llama instead of the 1.1B one (smoke test)")
    parser.add_argument("--preset", default="stage3", help="dstrain rows' preset")
    parser.add_argument("--accelerator", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--attn", default="sdpa", help="the peers' sp_attn_implementation / attn_implementation")
    parser.add_argument("--seq-lens", default="32768", help="comma-separated lengths measured on every layout")
    parser.add_argument("--no-max", action="store_true", help="skip the search for the longest sequence")
    parser.add_argument("--max-from", type=int, default=16384)
    parser.add_argument("--max-to", type=int, default=262144)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--log-every", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one run may take")
    parser.add_argument("--set", action="append", help="extra dstrain override for every dstrain row")
    parser.add_argument("--port", type=int, default=29517)
    parser.add_argument("--json", type=Path, default=None)
    # worker side (set by peer_row)
    parser.add_argument("--worker", choices=PEERS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--seq-len", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--sp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = [r for r in args.runners.split(",") if r and r not in RUNNERS]
    unknown += [v for v in args.variants.split(",") if v and v not in VARIANTS]
    if unknown:
        parser.error(f"unknown --runners or --variants {', '.join(unknown)}: use {', '.join(RUNNERS)}; "
                     f"{', '.join(VARIANTS)}")
    return args


def main() -> None:
    args = parse()
    if args.worker:
        return worker(args)
    model_dir = args.model_dir or Path(tempfile.mkdtemp(prefix="dstrain-long-context-"))
    if not (model_dir / "config.json").is_file():  # made once; a later call names the same --model-dir
        model_dir.mkdir(parents=True, exist_ok=True)
        make_tiny(model_dir) if args.tiny else reuse_or_make_llama(model_dir, LLAMA_1B)
    runners = [r for r in args.runners.split(",") if r]
    if "trl" in runners:
        print("TRL:", install_trl(), flush=True)
    if args.accelerator == "cuda":
        import torch
        present = torch.cuda.device_count()
    else:
        present = max(int(g) for g in args.gpus.split(","))  # CPU ranks: as many as asked
    rows: list[dict] = []
    print(HEADER, flush=True)

    def keep(row: dict) -> dict:  # written as it comes: a cut call, or a later run that crashes, loses nothing
        rows.append(row)
        print(describe(row), flush=True)
        if args.json:
            write_json(args.json, vars(args), rows, quiet=True)
        return row

    for runner in runners:
        for gpus, sp in (layout for layout in layouts(args) if layout[0] <= present):
            for variant in ([v for v in args.variants.split(",") if v] if runner == "dstrain" else [""]):
                def run(seq_len: int) -> dict:
                    if runner == "dstrain":
                        return dstrain_row(model_dir, gpus, sp, seq_len, args, variant)
                    return peer_row(runner, model_dir, gpus, sp, seq_len, args)
                for seq_len in (int(s) for s in args.seq_lens.split(",") if s):
                    keep(run(seq_len))
                if not args.no_max:  # doubles from --max-from until a run fails: the last that trained is the max
                    best, seq_len = None, args.max_from
                    while seq_len <= args.max_to:
                        row = keep(dict(run(seq_len), search="run"))
                        if row["status"] != "ok":
                            break
                        best, seq_len = row, seq_len * 2
                    top = best or {"runner": runner, "gpus": gpus, "sequence_parallel": sp, "seq_len": 0}
                    keep(dict(top, search="max", max_seq_len=best["seq_len"] if best else None,
                              status="ok" if best else "none fits"))
    if args.json:
        write_json(args.json, vars(args), rows)


if __name__ == "__main__":
    main()
