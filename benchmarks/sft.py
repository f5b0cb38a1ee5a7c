"""GPU benchmark: supervised fine-tuning on instruction data, dstrain against TRL's SFTTrainer (issue 36).

    source benchmarks/gpu_env.sh && python3 benchmarks/sft.py --out $OUT      # one H100, ~20 minutes
    python3 benchmarks/sft.py --rows 'z2-full-*' --out /tmp/o                 # a partial re-run
    python3 benchmarks/sft.py --tiny --out /tmp/o                             # CPU smoke run, minutes

What it builds (in --work, reused when there): a Llama-shaped model of 1.1B parameters (TinyLlama's shape,
max_position_embeddings 4096) with random weights, saved by save_pretrained in bf16 safetensors, with a
byte-level BPE tokenizer of 32,000 tokens trained here on the standard library's sources (BOS <s>, EOS </s>,
a <pad> token); an Alpaca-layout instruction set with Alpaca-GPT4's length distribution
(benchmarks/make_instruction_data.py, at the tokenizer's own characters per token).

Rows, each a fresh process, all at data.seq_len 4096, micro batch 4 rows, bf16, lr 2e-5, --steps steps:
  dstrain-z{2,3}-{full,lora}-{packed,padded}
      `python -m dstrain.cli run --preset stage2|stage3 --gpus 1 --set model.name=hf:DIR --set data.source=jsonl
      --set data.format=alpaca --set data.packing=true|false ...`: packed rows hold several whole examples each;
      padded rows hold one example padded to 4096 (what dstrain did before packing).
  trl-z{2,3}-{full,lora}
      TRL's SFTTrainer, packing=True (its default "bfd" strategy: padding-free, position ids per example),
      prompt/completion rows rendered with the same Alpaca prompt, through Trainer's DeepSpeed integration:
      `accelerate launch --config_file` an accelerate config naming a DeepSpeed JSON of the same ZeRO stage
      (the JSON of transformers' DeepSpeed docs: bf16, DeepSpeed's AdamW, "auto" filled in by Trainer).
LoRA rows: r 16, alpha 32, on every linear layer of the blocks (q,k,v,o,gate,up,down), both tools.

Reported per row: real_tokens_per_s, counting only tokens of examples (no padding): dstrain from
metrics.jsonl's real-token field (estimated from the data where that field is missing, and marked so),
TRL from the batches themselves (attention-mask sum, or the packed row's length where padding-free);
both as real tokens of the timed steps over their time (steps after --warmup, the device synchronised at
both ends); row_tokens_per_s (every position of the batch, padding included); peak GPU memory
(torch.cuda.max_memory_allocated); loss at the first and last step; wall time; the error tail of a failed
row. The table compares packed with padded and dstrain with TRL at equal stage; --out gets sft-<gpu>.json
(rows, date, GPU, versions) and each row's log.

On the GPU machine the TRL rows need TRL and datasets, which the image lacks: this script installs the
wheels carried in .whl/extra (trl, datasets, dill, multiprocess) into /tmp/site, as gpu_env.sh does for
DeepSpeed's.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
try:  # an importable dstrain (PYTHONPATH) wins: a trial of another branch points there
    import dstrain  # noqa: F401
except ImportError:
    sys.path.insert(0, str(REPO))
    import dstrain  # noqa: F401
DSTRAIN_ROOT = Path(dstrain.__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

LLAMA_1B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False,
                rms_norm_eps=1e-5, rope_theta=10000.0)
LLAMA_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024, tie_word_embeddings=False)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_R, LORA_ALPHA = 16, 32
LR = 2e-5
# Alpaca's own prompt (stanford_alpaca's train.py), used for TRL's prompts and for dstrain's format
# prompt_response where its branch lacks format "alpaca".
ALPACA_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further "
                "context. Write a response that appropriately completes the request.\n\n"
                "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately "
                   "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")
T0 = time.time()


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S', time.gmtime())} +{time.time() - T0:6.0f}s] {message}", flush=True)


# ---------------------------------------------------------------- setup: tokenizer, model, data

def build_tokenizer(directory: Path, vocab: int, text: str) -> float:
    """A Llama-like fast tokenizer (byte-level BPE, <s> before every text, </s> end, <pad>) trained on
    `text`; returns its characters per token on that text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    chunks = [text[i:i + 4096] for i in range(0, len(text), 4096)]
    bpe.train_from_iterator(chunks, trainer)
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", bpe.token_to_id("<s>"))])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>", pad_token="<pad>", model_max_length=1 << 20)
    tokenizer.save_pretrained(directory)
    sample = text[:200_000]
    return len(sample) / len(tokenizer(sample, add_special_tokens=False)["input_ids"])


def make_model(directory: Path, tiny: bool) -> dict:
    """Model folder (random weights, bf16 safetensors) + tokenizer; returns facts about it."""
    import torch
    from make_instruction_data import corpus_text
    from transformers import AutoModelForCausalLM, LlamaConfig

    shape = LLAMA_TINY if tiny else LLAMA_1B
    directory.mkdir(parents=True, exist_ok=True)
    text = corpus_text()
    # 32,000 merges from ~6 MB of text: ~20 s on one core; the tiny tokenizer from 1 MB
    chars_per_token = build_tokenizer(directory, shape["vocab_size"], text[: (1 if tiny else 6) * 1_000_000])
    torch.manual_seed(0)
    config = LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=3)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory, max_shard_size="1GB")
    facts = {"params": sum(p.numel() for p in model.parameters()), "shape": shape,
             "chars_per_token": chars_per_token}
    (directory / "bench_facts.json").write_text(json.dumps(facts, indent=2))
    return facts


def make_data(directory: Path, examples: int, chars_per_token: float, tokenizer_dir: Path, seq_len: int) -> dict:
    """alpaca.jsonl (+ sharegpt.jsonl) and prompt_completion.jsonl (the same examples, Alpaca's prompt
    rendered, for TRL and for dstrain's prompt_response); returns the measured token lengths."""
    from make_instruction_data import write
    from transformers import AutoTokenizer

    summary = write(directory, examples, seed=0, chars_per_token=chars_per_token)
    rows = [json.loads(line) for line in (directory / "alpaca.jsonl").read_text().splitlines()]
    rendered = [{"prompt": (ALPACA_INPUT if r["input"] else ALPACA_NO_INPUT).format(**r), "completion": r["output"]}
                for r in rows]
    with open(directory / "prompt_completion.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rendered)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    prompts = tokenizer([r["prompt"] for r in rendered])["input_ids"]  # with <s>
    completions = tokenizer([r["completion"] for r in rendered], add_special_tokens=False)["input_ids"]
    lengths = sorted(min(len(p) + len(c) + 1, seq_len) for p, c in zip(prompts, completions))  # + </s>
    summary.update({"example_tokens_mean": statistics.fmean(lengths),
                    "example_tokens_p50_p90_p99": [lengths[int(q * (len(lengths) - 1))] for q in (0.5, 0.9, 0.99)],
                    "prompt_tokens_mean": statistics.fmean(len(p) for p in prompts),
                    "completion_tokens_mean": statistics.fmean(len(c) for c in completions),
                    "padded_row_fill": statistics.fmean(lengths) / seq_len})
    (directory / "measured.json").write_text(json.dumps(summary, indent=2))
    return summary


# ---------------------------------------------------------------- dstrain rows

def dstrain_schema() -> dict:
    """What the dstrain under test accepts: format alpaca and data.packing exist only on newer branches."""
    from typing import get_args
    from dstrain.config.schema import DataConfig
    fields = DataConfig.model_fields
    return {"alpaca": "alpaca" in get_args(fields["format"].annotation), "packing": "packing" in fields}


def dstrain_row(name: str, stage: int, lora: bool, packed: bool, ctx: dict, args) -> dict:
    schema = dstrain_schema()
    row = {"name": name, "runner": "dstrain", "stage": stage, "lora": lora, "packed": packed}
    if packed and not schema["packing"]:
        return {**row, "error": "this dstrain has no data.packing (the ft-data branch adds it)"}
    run_dir = args.work / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    data_sets = ([f"data.paths=[{ctx['data'] / 'alpaca.jsonl'}]", "data.format=alpaca"] if schema["alpaca"] else
                 [f"data.paths=[{ctx['data'] / 'prompt_completion.jsonl'}]", "data.format=prompt_response",
                  "data.fields.prompt=prompt", "data.fields.response=completion"])
    sets = [f"model.name=hf:{ctx['model']}", "data.source=jsonl", *data_sets, f"data.seq_len={args.seq_len}",
            f"data.cache_dir={args.work / 'dstrain-cache'}", f"train.micro_batch_size={args.micro_batch}",
            f"train.max_steps={args.steps}", "train.log_every=1", "train.save_checkpoints=false",
            "train.eval_every=1000000", "train.eval_batches=1", "train.warmup_steps=2", f"train.lr={LR}",
            f"train.seed={args.seed}"]
    if schema["packing"]:
        sets.append(f"data.packing={'true' if packed else 'false'}")
    if args.accelerator == "cuda":
        sets.append("train.precision=bf16")
    if lora:
        sets += [f"model.lora.r={LORA_R}", f"model.lora.alpha={LORA_ALPHA}",
                 f"model.lora.target_modules=[{','.join(LORA_TARGETS)}]"]
    command = [sys.executable, "-m", "dstrain.cli", "run", "--preset", f"stage{stage}", "--gpus", "1",
               "--accelerator", args.accelerator, "--run-dir", str(run_dir)]
    for item in sets + (args.dstrain_set or []):
        command += ["--set", item]
    code, wall, tail = run_logged(command, args.out / "logs" / f"{name}.log", args.row_limit, cwd=DSTRAIN_ROOT)
    row.update({"wall_s": round(wall, 1), "command": " ".join(command)})
    metrics_path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics_path.read_text().splitlines()] if metrics_path.exists() else []
    steps = [r for r in records if "loss" in r and "step_time_ms" in r]
    start = next((r for r in records if r.get("event") == "run_start"), {})
    row["run_start"] = {k: v for k, v in start.items() if k not in ("event", "step", "time", "peak_tflops")}
    if code or not steps:
        return {**row, "error": f"exit {code}: {tail}"}
    timed = [r for r in steps if r["step"] > args.warmup] or steps[-1:]
    seconds = sum(r["step_time_ms"] for r in timed) / 1000  # log_every 1: one step per record
    real_key = next((k for k in timed[0] if "real" in k and k.endswith("tokens_per_s")), None)
    if real_key:
        real = sum(r[real_key] * r["step_time_ms"] / 1000 for r in timed)
        row["real_tokens_source"] = f"metrics.jsonl {real_key}"
    else:  # no per-step real-token count in this dstrain: the data's mean fill of a row
        fill = 1.0 if packed else ctx["lengths"]["padded_row_fill"]
        real = sum(r["tokens_per_s"] * r["step_time_ms"] / 1000 for r in timed) * fill
        row["real_tokens_source"] = f"estimated: row tokens x {fill:.4f} (the data's mean fill of a row)"
    row.update({"real_tokens_per_s": real / seconds,
                "row_tokens_per_s": sum(r["tokens_per_s"] * r["step_time_ms"] / 1000 for r in timed) / seconds,
                "step_s_median": statistics.median(r["step_time_ms"] for r in timed) / 1000,
                "timed_steps": len(timed), "peak_gpu_gib": max(r.get("memory_gib", 0.0) for r in steps),
                "first_loss": steps[0]["loss"], "last_loss": steps[-1]["loss"],
                "extra": {k: v for k, v in steps[-1].items() if any(w in k for w in ("pack", "real", "pad", "fill"))}})
    ds_config = run_dir / "ds_config.json"
    if ds_config.exists():
        row["ds_config"] = json.loads(ds_config.read_text())
    return row


# ---------------------------------------------------------------- TRL rows

def trl_ds_config(stage: int) -> dict:
    """The DeepSpeed JSON of transformers' DeepSpeed docs for this stage ("auto" filled by Trainer)."""
    zero = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": "auto"}
    if stage == 2:
        zero.update({"allgather_partitions": True, "allgather_bucket_size": 2e8, "reduce_scatter": True})
    else:
        zero.update({"sub_group_size": 1e9, "stage3_prefetch_bucket_size": "auto",
                     "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
                     "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": False})
    return {"bf16": {"enabled": "auto"}, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                      "weight_decay": "auto"}},
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": "auto", "steps_per_print": 1000000, "wall_clock_breakdown": False}


def trl_row(name: str, stage: int, lora: bool, ctx: dict, args) -> dict:
    row = {"name": name, "runner": "trl", "stage": stage, "lora": lora, "packed": True}
    where = args.work / "runs" / name
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    spec = {"model": str(ctx["model"]), "data": str(ctx["data"] / "prompt_completion.jsonl"), "lora": lora,
            "seq_len": args.seq_len, "micro_batch": args.micro_batch, "steps": args.steps, "warmup": args.warmup,
            "seed": args.seed, "output_dir": str(where / "out"), "result": str(where / "result.json"),
            "cuda": args.accelerator == "cuda"}
    (where / "spec.json").write_text(json.dumps(spec))
    use_deepspeed = args.trl_deepspeed == "on"
    if use_deepspeed:
        (where / "ds_config.json").write_text(json.dumps(trl_ds_config(stage), indent=2))
        accelerate_config = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "DEEPSPEED",
                             "deepspeed_config": {"deepspeed_config_file": str(where / "ds_config.json"),
                                                  "zero3_init_flag": stage == 3},
                             "machine_rank": 0, "main_training_function": "main", "num_machines": 1,
                             "num_processes": 1, "rdzv_backend": "static", "same_network": True,
                             "use_cpu": args.accelerator == "cpu"}
    else:
        accelerate_config = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "NO", "num_machines": 1,
                             "num_processes": 1, "machine_rank": 0, "mixed_precision": "no",
                             "use_cpu": args.accelerator == "cpu"}
    (where / "accelerate.yaml").write_text(json.dumps(accelerate_config, indent=2))  # JSON is YAML
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(where / "accelerate.yaml"),
               str(Path(__file__).resolve()), "trl-child", "--spec", str(where / "spec.json")]
    code, wall, tail = run_logged(command, args.out / "logs" / f"{name}.log", args.row_limit, cwd=REPO)
    row.update({"wall_s": round(wall, 1), "deepspeed": use_deepspeed, "command": " ".join(command)})
    result = where / "result.json"
    if code or not result.exists():
        return {**row, "error": f"exit {code}: {tail}"}
    row.update(json.loads(result.read_text()))
    if use_deepspeed:
        row["ds_config"] = trl_ds_config(stage)
    return row


def trl_child(spec_path: Path) -> None:
    """Inside accelerate's process: what a TRL user writes, plus a counter of the batches' real tokens."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    spec = json.loads(spec_path.read_text())
    rows = [json.loads(line) for line in Path(spec["data"]).read_text().splitlines()]
    dataset = Dataset.from_list(rows)
    peft_config = None
    if spec["lora"]:
        from peft import LoraConfig
        peft_config = LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=LORA_TARGETS,
                                 task_type="CAUSAL_LM")
    config = SFTConfig(output_dir=spec["output_dir"], max_length=spec["seq_len"], packing=True,
                       per_device_train_batch_size=spec["micro_batch"], gradient_accumulation_steps=1,
                       max_steps=spec["steps"], learning_rate=LR, warmup_steps=2, weight_decay=0.1,
                       adam_beta1=0.9, adam_beta2=0.95, max_grad_norm=1.0, logging_steps=1, save_strategy="no",
                       report_to="none", bf16=spec["cuda"], gradient_checkpointing=False, seed=spec["seed"],
                       disable_tqdm=True, use_cpu=not spec["cuda"],
                       model_init_kwargs={"dtype": torch.bfloat16 if spec["cuda"] else torch.float32})

    class Counting(SFTTrainer):
        real_tokens = row_tokens = 0

        def compute_loss(self, model, inputs, *rest, **kwargs):
            if model.training:
                if "attention_mask" in inputs:
                    Counting.real_tokens += int(inputs["attention_mask"].sum())
                else:  # padding-free: one row of whole examples, no padding unless pad_to_multiple_of
                    Counting.real_tokens += int((inputs["input_ids"] != self.processing_class.pad_token_id).sum()
                                                if self.args.pad_to_multiple_of not in (None, "auto")
                                                else inputs["position_ids"].size(1))
                Counting.row_tokens += inputs["input_ids"].numel()
            return super().compute_loss(model, inputs, *rest, **kwargs)

    def sync():
        if spec["cuda"]:
            torch.cuda.synchronize()

    class Timer(TrainerCallback):
        def __init__(self):
            self.marks, self.losses, self.step_ends = {}, [], []

        def on_step_end(self, args, state, control, **kwargs):
            self.step_ends.append(time.perf_counter())
            if state.global_step in (spec["warmup"], spec["steps"]):
                sync()
                self.marks[state.global_step] = (time.perf_counter(), Counting.real_tokens, Counting.row_tokens)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses.append(logs["loss"])

    timer = Timer()
    trainer = Counting(model=spec["model"], args=config, train_dataset=dataset, peft_config=peft_config,
                       callbacks=[timer])
    if spec["cuda"]:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    if trainer.accelerator.is_main_process:
        (t0, real0, rows0), (t1, real1, rows1) = timer.marks[spec["warmup"]], timer.marks[spec["steps"]]
        gaps = [b - a for a, b in zip(timer.step_ends[spec["warmup"] - 1:], timer.step_ends[spec["warmup"]:])]
        Path(spec["result"]).write_text(json.dumps({
            "real_tokens_per_s": (real1 - real0) / (t1 - t0), "row_tokens_per_s": (rows1 - rows0) / (t1 - t0),
            "real_tokens_source": "batches: attention-mask sum, or the padding-free row's length",
            "step_s_median": statistics.median(gaps) if gaps else None, "timed_steps": spec["steps"] - spec["warmup"],
            "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if spec["cuda"] else None,
            "first_loss": timer.losses[0] if timer.losses else None,
            "last_loss": timer.losses[-1] if timer.losses else None,
            "attn_implementation": getattr(trainer.model.config, "_attn_implementation", None),
            "padding_free": getattr(trainer, "padding_free", None),
            "gradient_checkpointing": bool(getattr(trainer.model, "is_gradient_checkpointing", False))}))


# ---------------------------------------------------------------- running and reporting

def run_logged(command: list[str], log_path: Path, timeout: float, cwd: Path) -> tuple[int, float, str]:
    """Run `command`, its output to `log_path` (a progress line every minute); (exit code, seconds, tail)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(DSTRAIN_ROOT)) if p)
    started = time.perf_counter()
    with open(log_path, "w") as out:
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        code = None
        while code is None:
            try:
                code = process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                elapsed = time.perf_counter() - started
                last = log_path.read_text(errors="replace").strip().splitlines()[-1:] or [""]
                log(f"  ... {elapsed:.0f}s: {last[0][-160:]}")
                if elapsed > timeout:
                    os.killpg(process.pid, 9)
                    process.wait()
                    code = 124
    wall = time.perf_counter() - started
    tail = log_path.read_text(errors="replace")[-3000:]
    return code, wall, tail


def plan_rows(args) -> list[tuple]:
    """(name, runner, stage, lora, packed) in the order run: per stage and mode, dstrain packed, TRL, padded."""
    rows = []
    for stage in (2, 3):
        for mode in ("full", "lora"):
            lora = mode == "lora"
            rows += [(f"dstrain-z{stage}-{mode}-packed", "dstrain", stage, lora, True),
                     (f"trl-z{stage}-{mode}", "trl", stage, lora, True),
                     (f"dstrain-z{stage}-{mode}-padded", "dstrain", stage, lora, False)]
    if args.rows:
        patterns = [p if any(c in p for c in "*?[") else f"*{p}*" for p in args.rows.split(",")]
        rows = [r for r in rows if any(fnmatch.fnmatch(r[0], p) for p in patterns)]
    return rows


def install_extras() -> str:
    """On the GPU machine: TRL and datasets from .whl/extra into /tmp/site (on PYTHONPATH via gpu_env.sh)."""
    import importlib.util
    extra = REPO / ".whl" / "extra"
    if importlib.util.find_spec("trl") and importlib.util.find_spec("datasets"):
        return "already importable"
    if not extra.is_dir():
        return "no .whl/extra: TRL rows will fail unless trl and datasets are installed"
    try:
        import importlib.metadata as md
        arrow = tuple(int(x) for x in md.version("pyarrow").split(".")[:1])
    except Exception:  # noqa: BLE001 - no pyarrow: datasets cannot work either way
        arrow = (0,)
    wheels = [w for w in sorted(extra.glob("*.whl"))
              if not w.name.startswith("datasets-") or w.name.startswith("datasets-5" if arrow >= (24,) else "datasets-4")]
    target, said = "/tmp/site", []
    for wheel in wheels:  # one at a time: a wheel that does not install does not take the others with it
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                               "--no-compile", "--target", target, str(wheel)], capture_output=True, text=True)
        said.append(wheel.name + ("" if done.returncode == 0 else f" FAILED: {done.stderr.strip()[-300:]}"))
    if target not in os.environ.get("PYTHONPATH", "").split(os.pathsep):  # gpu_env.sh puts it there already
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (target, os.environ.get("PYTHONPATH")) if p)
    return "installed into /tmp/site: " + "; ".join(said)


def versions() -> dict:
    import importlib.metadata as md
    out = {"python": platform.python_version()}
    for package in ("torch", "deepspeed", "transformers", "trl", "peft", "accelerate", "datasets", "tokenizers",
                    "pyarrow"):
        try:
            out[package] = md.version(package)
        except md.PackageNotFoundError:
            out[package] = None
    try:
        out["dstrain_commit"] = subprocess.run(["git", "-C", str(DSTRAIN_ROOT), "rev-parse", "--short", "HEAD"],
                                               capture_output=True, text=True).stdout.strip() or None
    except OSError:
        out["dstrain_commit"] = None
    return out


def versions_in_child() -> dict:
    """Versions as the rows see them (PYTHONPATH with /tmp/site), from a fresh interpreter."""
    env = dict(os.environ)
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "versions"], capture_output=True,
                          text=True, env=env)
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return versions()


def table(rows: list[dict]) -> str:
    lines = [f"{'row':26} {'real tok/s':>11} {'row tok/s':>10} {'peak GiB':>8} {'loss first>last':>16} "
             f"{'vs padded':>9} {'vs TRL':>7}"]
    by_name = {r["name"]: r for r in rows}
    for r in rows:
        if "error" in r:
            lines.append(f"{r['name']:26} failed: {r['error'].strip().splitlines()[-1][-100:] if r['error'].strip() else ''}")
            continue
        stage_mode = r["name"].split("-")[1:3]
        padded = by_name.get(f"dstrain-{stage_mode[0]}-{stage_mode[1]}-padded", {})
        trl = by_name.get(f"trl-{stage_mode[0]}-{stage_mode[1]}", {})
        vs_padded = (f"{r['real_tokens_per_s'] / padded['real_tokens_per_s']:.2f}x"
                     if r["runner"] == "dstrain" and r["packed"] and padded.get("real_tokens_per_s") else "")
        vs_trl = (f"{r['real_tokens_per_s'] / trl['real_tokens_per_s']:.2f}x"
                  if r["runner"] == "dstrain" and trl.get("real_tokens_per_s") else "")
        memory = f"{r['peak_gpu_gib']:.1f}" if r.get("peak_gpu_gib") is not None else "-"
        loss = (f"{r['first_loss']:.3f}>{r['last_loss']:.3f}" if r.get("first_loss") is not None
                and r.get("last_loss") is not None else "")
        mark = "~" if str(r.get("real_tokens_source", "")).startswith("estimated") else ""
        lines.append(f"{r['name']:26} {r['real_tokens_per_s']:>10,.0f}{mark or ' '} {r['row_tokens_per_s']:>10,.0f} "
                     f"{memory:>8} {loss:>16} {vs_padded:>9} {vs_trl:>7}")
    if any(str(r.get("real_tokens_source", "")).startswith("estimated") for r in rows):
        lines.append("~ estimated from the data's mean row fill (this dstrain logs no real-token count)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", default="bench", choices=["bench", "trl-child", "versions"])
    parser.add_argument("--spec", type=Path, help="trl-child: its spec file")
    parser.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None,
                        help="where the JSON and the logs go (default $OUT)")
    parser.add_argument("--work", type=Path, default=None,
                        help="model, data and run folders; reused when there (default /tmp/dstrain-sft[-tiny])")
    parser.add_argument("--rows", default=None, help="comma-separated row names or globs, e.g. 'z2-full-*,trl-z3-*'")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: a tiny Llama, seq_len 512, 3 steps")
    parser.add_argument("--accelerator", choices=("cuda", "cpu"), default=None)
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps a row (default 16; tiny 3)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed first steps (default 4; tiny 1)")
    parser.add_argument("--seq-len", type=int, default=None, help="default 4096; tiny 512")
    parser.add_argument("--micro-batch", type=int, default=None, help="rows a step (default 4; tiny 2)")
    parser.add_argument("--examples", type=int, default=None, help="instruction examples (default 6000; tiny 400)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--row-timeout", type=float, default=None, help="seconds a row may take (default 300)")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for the whole command; rows that would start later are skipped (default 1320)")
    parser.add_argument("--trl-deepspeed", choices=("on", "off"), default="on",
                        help="TRL through accelerate's DeepSpeed plugin (off: accelerate without DeepSpeed)")
    parser.add_argument("--dstrain-set", action="append", help="extra --set for the dstrain rows")
    args = parser.parse_args()
    if args.command == "trl-child":
        trl_child(args.spec)
        return
    if args.command == "versions":
        print(json.dumps(versions()))
        return

    tiny = args.tiny
    args.accelerator = args.accelerator or ("cpu" if tiny else "cuda")
    for key, full, small in (("steps", 16, 3), ("warmup", 4, 1), ("seq_len", 4096, 512), ("micro_batch", 4, 2),
                             ("examples", 6000, 400), ("row_timeout", 300, 900),
                             ("budget", 1320, 3600)):
        if getattr(args, key) is None:
            setattr(args, key, small if tiny else full)
    if args.warmup >= args.steps:
        parser.error("--warmup must be below --steps")
    args.work = args.work or Path(tempfile.gettempdir()) / ("dstrain-sft-tiny" if tiny else "dstrain-sft")
    args.out = args.out or args.work / "out"
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    log(f"dstrain from {DSTRAIN_ROOT}; work {args.work}; out {args.out}")
    if args.accelerator == "cuda":
        log(f"extras: {install_extras()}")

    model_dir, data_dir = args.work / "model", args.work / "data"
    facts_file = model_dir / "bench_facts.json"
    if facts_file.exists() and json.loads(facts_file.read_text())["shape"] == (LLAMA_TINY if tiny else LLAMA_1B):
        facts = json.loads(facts_file.read_text())
        log(f"model reused: {model_dir}")
    else:
        log("building the tokenizer and the model (random weights, bf16 safetensors)")
        facts = make_model(model_dir, tiny)
        log(f"model: {facts['params'] / 1e9:.3f}B parameters, tokenizer {facts['chars_per_token']:.2f} chars/token")
    lengths = make_data(data_dir, args.examples, facts["chars_per_token"], model_dir, args.seq_len)
    log(f"data: {args.examples} examples, mean {lengths['example_tokens_mean']:.0f} tokens (prompt "
        f"{lengths['prompt_tokens_mean']:.0f}, completion {lengths['completion_tokens_mean']:.0f}), p50/p90/p99 "
        f"{lengths['example_tokens_p50_p90_p99']}; a padded row is {100 * lengths['padded_row_fill']:.1f}% real")
    ctx = {"model": model_dir, "data": data_dir, "lengths": lengths}

    device = "cpu"
    if args.accelerator == "cuda":
        import torch
        device = torch.cuda.get_device_name(0)
    doc = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "host": platform.node(), "device": device,
           "versions": versions_in_child(), "model": facts, "data": lengths, "dstrain_schema": dstrain_schema(),
           "settings": {k: str(v) for k, v in vars(args).items()}, "rows": []}
    log(f"versions: {json.dumps(doc['versions'])}")
    short = re.search(r"\b([A-Z]\d{2,4}[A-Z]?)\b", device)  # "NVIDIA H100 80GB HBM3" -> h100
    out_file = args.out / f"sft-{short.group(1).lower() if short else 'cpu' if device == 'cpu' else 'gpu'}.json"
    planned = plan_rows(args)
    log(f"{len(planned)} rows: {', '.join(r[0] for r in planned)}")
    if out_file.exists():  # a partial re-run (--rows) keeps the rows of the earlier run it does not repeat
        again = {r[0] for r in planned}
        doc["rows"] = [r for r in json.loads(out_file.read_text()).get("rows", []) if r["name"] not in again]
    for name, runner, stage, lora, packed in planned:
        left = args.budget - (time.time() - T0)
        if left < 60:  # the device call has a hard end: keep what is measured, say what was not
            log(f"row {name}: skipped, {args.budget:.0f}s budget spent")
            doc["rows"].append({"name": name, "runner": runner, "stage": stage, "lora": lora, "packed": packed,
                                "error": f"skipped: the {args.budget:.0f}s budget (--budget) was spent"})
            continue
        args.row_limit = min(args.row_timeout, left)
        log(f"row {name}: start (at most {args.row_limit:.0f}s)")
        try:
            row = (dstrain_row(name, stage, lora, packed, ctx, args) if runner == "dstrain"
                   else trl_row(name, stage, lora, ctx, args))
        except Exception as err:  # noqa: BLE001 - one broken row must not lose the others
            row = {"name": name, "runner": runner, "stage": stage, "lora": lora, "packed": packed,
                   "error": f"{type(err).__name__}: {err}"}
        row["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        doc["rows"].append(row)
        out_file.write_text(json.dumps(doc, indent=2) + "\n")  # after every row: a cut-off call keeps the rest
        if "error" in row:
            log(f"row {name}: FAILED after {row.get('wall_s', '?')}s: {row['error'][-600:]}")
        else:
            log(f"row {name}: {row['real_tokens_per_s']:,.0f} real tok/s, {row['row_tokens_per_s']:,.0f} row tok/s, "
                f"peak {row['peak_gpu_gib'] if row['peak_gpu_gib'] is None else round(row['peak_gpu_gib'], 2)} GiB, "
                f"loss {row['first_loss']} -> {row['last_loss']}, {row['wall_s']}s")
    order = [r[0] for r in plan_rows(argparse.Namespace(rows=None))]
    doc["rows"].sort(key=lambda r: order.index(r["name"]) if r["name"] in order else len(order))
    out_file.write_text(json.dumps(doc, indent=2) + "\n")
    print("\n" + table(doc["rows"]), flush=True)
    log(f"written to {out_file}")


if __name__ == "__main__":
    main()
