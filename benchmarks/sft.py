"""GPU benchmark: supervised fine-tuning on instruction data, dstrain against TRL's SFTTrainer (issue 36).

    source benchmarks/gpu_env.sh && python3 benchmarks/sft.py --out $OUT      # one H100, ~20 minutes
    python3 benchmarks/sft.py --rows 'z2-full-*' --out /tmp/o                 # a partial re-run
    python3 benchmarks/sft.py --tiny --out /tmp/o                             # CPU smoke run, minutes

A Llama of TinyLlama's shape (1.1B, random weights, max_position_embeddings 4096) with a 32,000-token
byte-level BPE tokenizer trained here, and an Alpaca-layout instruction set with Alpaca-GPT4's lengths
(make_instruction_data.py), built once in --work. Rows, each a fresh process, seq_len 4096, micro batch 4, bf16:
  dstrain-z{2,3}-{full,lora}-{packed,padded}   `dstrain run` with data.format alpaca, data.packing true/false
  trl-z{2,3}-{full,lora}   TRL's SFTTrainer (packing=True, padding-free), the same examples with Alpaca's prompt,
                           through `accelerate launch` with the DeepSpeed JSON of transformers' docs at that stage
LoRA: r 16, alpha 32 on q,k,v,o,gate,up,down. Reported: real tokens/s (no padding) and row tokens/s over the
steps after --warmup, peak GPU memory, first and last loss; --out gets sft-<gpu>.json and each row's log.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import time
from pathlib import Path

from run_record import (LLAMA_1B, bench_args, bench_parser, device_name, install_trl, log, pick, rate, reuse_or_make_llama, run_dstrain,
                        run_logged, run_rows, short_name, versions_in_child)

SHAPE = dict(LLAMA_1B, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0)
LLAMA_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024, tie_word_embeddings=False)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_R, LORA_ALPHA = 16, 32
LR = 2e-5
# Alpaca's own prompt (stanford_alpaca's train.py): TRL's prompts, as dstrain's format alpaca renders them
ALPACA_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further "
                "context. Write a response that appropriately completes the request.\n\n"
                "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately "
                   "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")


# ---------------------------------------------------------------- setup: tokenizer, model, data

def make_data(directory: Path, examples: int, chars_per_token: float, tokenizer_dir: Path, seq_len: int) -> dict:
    """alpaca.jsonl (+ sharegpt.jsonl) and prompt_completion.jsonl (the same examples, Alpaca's prompt
    rendered, for TRL); returns the measured token lengths."""
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

def dstrain_row(name: str, stage: int, lora: bool, packed: bool, ctx: dict, args) -> dict:
    sets = [f"model.name=hf:{ctx['model']}", "data.source=jsonl", f"data.paths=[{ctx['data'] / 'alpaca.jsonl'}]",
            "data.format=alpaca", f"data.packing={'true' if packed else 'false'}", f"data.seq_len={args.seq_len}",
            f"data.cache_dir={args.work / 'dstrain-cache'}", f"train.micro_batch_size={args.micro_batch}",
            f"train.max_steps={args.steps}", "train.warmup_steps=2", f"train.lr={LR}", f"train.seed={args.seed}"]
    if args.accelerator == "cuda":
        sets.append("train.precision=bf16")
    if lora:
        sets += [f"model.lora.r={LORA_R}", f"model.lora.alpha={LORA_ALPHA}",
                 f"model.lora.target_modules=[{','.join(LORA_TARGETS)}]"]
    row, steps = run_dstrain(name, f"stage{stage}", sets, args)
    row.update(name=name, runner="dstrain", stage=stage, lora=lora, packed=packed)
    if "error" in row:
        return row
    timed = [r for r in steps if r["step"] > args.warmup] or steps[-1:]
    row.update({"real_tokens_per_s": rate(timed, "real_tokens_per_s"), "row_tokens_per_s": rate(timed),
                "real_tokens_source": "metrics.jsonl real_tokens_per_s",
                "step_s_median": statistics.median(r["step_time_ms"] for r in timed) / 1000,
                "timed_steps": len(timed), "peak_gpu_gib": max(r.get("memory_gib", 0.0) for r in steps),
                "first_loss": steps[0]["loss"], "last_loss": steps[-1]["loss"],
                "ds_config": json.loads((args.work / "runs" / name / "ds_config.json").read_text())})
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


def launch_trl(name: str, stage: int, child: dict, script: Path, args) -> dict:
    """A TRL row as a user runs it on one GPU: `accelerate launch` of `script trl-child` with accelerate's DeepSpeed
    plugin reading trl_ds_config(stage); the row's facts, the child's result.json added, or its error."""
    where = args.work / "runs" / name
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    child.update(seed=args.seed, steps=args.steps, warmup=args.warmup, seq_len=args.seq_len,
                 output_dir=str(where / "out"), result=str(where / "result.json"), cuda=args.accelerator == "cuda")
    (where / "spec.json").write_text(json.dumps(child))
    (where / "ds_config.json").write_text(json.dumps(trl_ds_config(stage), indent=2))
    accelerate_config = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "DEEPSPEED",
                         "deepspeed_config": {"deepspeed_config_file": str(where / "ds_config.json"),
                                              "zero3_init_flag": stage == 3},
                         "machine_rank": 0, "main_training_function": "main", "num_machines": 1,
                         "num_processes": 1, "rdzv_backend": "static", "same_network": True,
                         "use_cpu": args.accelerator == "cpu"}
    (where / "accelerate.yaml").write_text(json.dumps(accelerate_config, indent=2))  # JSON is YAML
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(where / "accelerate.yaml"),
               str(script), "trl-child", "--spec", str(where / "spec.json")]
    code, wall, tail = run_logged(command, args.out / "logs" / f"{name}.log", args.row_limit)
    row = {"wall_s": round(wall, 1), "command": " ".join(command), "ds_config": trl_ds_config(stage)}
    result = where / "result.json"
    if code or not result.exists():
        return {**row, "error": f"exit {code}: {tail[-1500:]}"}
    return {**row, **json.loads(result.read_text())}


def trl_row(name: str, stage: int, lora: bool, ctx: dict, args) -> dict:
    child = {"model": str(ctx["model"]), "data": str(ctx["data"] / "prompt_completion.jsonl"), "lora": lora,
             "micro_batch": args.micro_batch}
    return {"name": name, "runner": "trl", "stage": stage, "lora": lora, "packed": True,
            **launch_trl(name, stage, child, Path(__file__).resolve(), args)}

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

def plan_rows(wanted: str | None) -> list[dict]:
    """The rows in the order run: per stage and mode, dstrain packed, TRL, dstrain padded; `wanted`: --rows."""
    rows = []
    for stage in (2, 3):
        for mode in ("full", "lora"):
            rows += [dict(name=f"dstrain-z{stage}-{mode}-packed", runner="dstrain", packed=True),
                     dict(name=f"trl-z{stage}-{mode}", runner="trl", packed=True),
                     dict(name=f"dstrain-z{stage}-{mode}-padded", runner="dstrain", packed=False)]
            for row in rows[-3:]:
                row.update(stage=stage, lora=mode == "lora")
    return pick(rows, wanted)


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
        lines.append(f"{r['name']:26} {r['real_tokens_per_s']:>10,.0f}  {r['row_tokens_per_s']:>10,.0f} "
                     f"{memory:>8} {loss:>16} {vs_padded:>9} {vs_trl:>7}")
    return "\n".join(lines)


DEFAULTS = {"steps": (16, 3), "warmup": (4, 1), "seq_len": (4096, 512), "micro_batch": (4, 2),
            "examples": (6000, 400), "row_timeout": (300.0, 900.0), "budget": (1320.0, 3600.0)}


def main() -> None:
    args = bench_args(bench_parser(__doc__, DEFAULTS), DEFAULTS, "sft")
    if args.command == "trl-child":
        trl_child(args.spec)
        return
    tiny = args.tiny
    log(f"work {args.work}; out {args.out}" + (f"; TRL: {install_trl()}" if args.accelerator == "cuda" else ""))

    model_dir, data_dir = args.work / "model", args.work / "data"
    facts = reuse_or_make_llama(model_dir, LLAMA_TINY if tiny else SHAPE, tokenizer_vocab=512 if tiny else 32000,
                                text_chars=(1 if tiny else 6) * 1_000_000)
    lengths = make_data(data_dir, args.examples, facts["chars_per_token"], model_dir, args.seq_len)
    log(f"data: {args.examples} examples, mean {lengths['example_tokens_mean']:.0f} tokens (prompt "
        f"{lengths['prompt_tokens_mean']:.0f}, completion {lengths['completion_tokens_mean']:.0f}), p50/p90/p99 "
        f"{lengths['example_tokens_p50_p90_p99']}; a padded row is {100 * lengths['padded_row_fill']:.1f}% real")
    ctx = {"model": model_dir, "data": data_dir, "lengths": lengths}
    device = device_name(args.accelerator == "cuda")
    doc = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": device,
           "versions": versions_in_child(), "model": facts, "data": lengths,
           "settings": {k: str(v) for k, v in vars(args).items()}, "rows": []}
    out_file = args.out / f"sft-{short_name(device)}.json"

    def run_one(spec: dict) -> dict:
        if spec["runner"] == "dstrain":
            return dstrain_row(spec["name"], spec["stage"], spec["lora"], spec["packed"], ctx, args)
        return trl_row(spec["name"], spec["stage"], spec["lora"], ctx, args)

    def describe(row: dict) -> str:
        return (f"{row['real_tokens_per_s']:,.0f} real tok/s, {row['row_tokens_per_s']:,.0f} row tok/s, peak "
                f"{row['peak_gpu_gib']} GiB, loss {row['first_loss']} -> {row['last_loss']}, {row['wall_s']}s")
    run_rows(plan_rows(args.rows), run_one, describe, doc, out_file, args,
             order=[spec["name"] for spec in plan_rows(None)])
    print("\n" + table(doc["rows"]), flush=True)


if __name__ == "__main__":
    main()
