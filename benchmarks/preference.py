"""GPU benchmark: DPO on preference pairs, dstrain against TRL 1.16's DPOTrainer (issue 52, item 9).

    source benchmarks/gpu_env.sh && python3 benchmarks/preference.py --out $OUT    # one H200: ~14 minutes for all rows
    (a 10-minute device call runs the first four rows: --budget skips the rest; then --rows the others)
    python3 benchmarks/preference.py --rows 'trl-*' --out /tmp/o                   # a partial re-run
    python3 benchmarks/preference.py --tiny --out /tmp/o                           # CPU smoke run (dstrain rows)

What it builds (in --work, reused when there):
- a model of Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 heads, 8 key-value heads, MLP 8192, vocabulary
  128,256, tied embeddings; 1.24B parameters; no rope scaling) with random weights, saved by save_pretrained in
  bf16 safetensors, with the 32,000-token byte-level BPE tokenizer of benchmarks/sft.py (the text uses the first
  32,000 ids; the embedding and the head keep Llama-3.2's 128,256 rows, so the LM head costs what it costs there);
- pairs.jsonl: --pairs rows {"prompt", "chosen", "rejected"} with UltraFeedback-like lengths (log-normal, a long
  right tail): prompt median 100 tokens, sigma 0.9 (mean ~150); each completion median 200, sigma 0.67
  (mean ~250), drawn independently; a pair's four parts together (2 x prompt + chosen + rejected, the tokens of
  its two examples) are kept under 0.9 x --seq-len by shortening the longer completion, so neither dstrain nor TRL
  truncates anything. The text is real (Python's standard-library sources, cut at the sampled lengths by
  benchmarks/make_instruction_data.py's `cut`); the token lengths are measured with the tokenizer and reported.

Rows, each a fresh process, the same data, initial weights, bf16, lr, a constant lr from the first step (no warm-up),
AdamW (betas 0.9/0.999, no weight decay, clip 1.0), DPO sigmoid loss with beta 0.1, and the same global batch,
--global-pairs pairs a step (default 16):
  dstrain-z3-full-packed       ZeRO-3 full fine-tune, preference.reference model (a live frozen copy), whole
                               pairs packed into rows of --seq-len; micro batch of packed rows, 2 micro batches a
                               step, the even number of rows a step nearest to --global-pairs pairs on average (a packed
                               step's pair count varies; pairs/s counts the pairs each step really had)
  dstrain-z3-full-unpacked     the same, data.packing false: one example a row padded to --seq-len, 4 pairs a
                               micro batch x accumulation (exactly --global-pairs pairs a step)
  dstrain-z2-lora-packed       LoRA (r 16, alpha 32, q/k/v/o/gate/up/down) at ZeRO-2, reference adapters_off
  dstrain-z3-full-packed-precomputed   preference.reference precomputed: the reference's log-probs computed in one
                               no-grad pass before training (its time is in launch > first step), no second model
  dstrain-z3-full-packed-ac    dstrain with activation checkpointing, against TRL's default
  dstrain-z3-full-packed-precomputed-ac   the precomputed reference with activation checkpointing: no second
                               model in memory (the reference's share of the peak)
  trl-z3-full-gc / -nogc       TRL's DPOTrainer (model given as its path: TRL loads the policy and the reference),
                               DPOConfig defaults except what must match (batch, steps, lr and schedule, bf16,
                               max_length = --seq-len so nothing is truncated, logging every step): gc = its
                               default gradient_checkpointing True, nogc = False; 4 pairs a micro batch x
                               accumulation; run as a user runs it on one GPU: `accelerate launch` with
                               accelerate's DeepSpeed plugin reading a DeepSpeed JSON of the same ZeRO stage
                               (benchmarks/sft.py's trl_ds_config, the JSON of transformers' DeepSpeed docs)
  trl-z2-lora-gc / -nogc       TRL with peft_config (the same LoRA) at ZeRO-2; TRL's reference is the adapters off

Data order: the unpacked dstrain row and the TRL rows train on the same pairs in the same micro batches (the
TRL child orders the dataset by dstrain's seeded permutation of the training pairs and reads it sequentially),
so their per-step losses are comparable step by step; the packed rows see the same pairs in another grouping.

Reported per row: pairs/s and real tokens/s over the steps after --warmup (total over the timed steps / their
time); dstrain's from metrics.jsonl (step_time_ms, real_tokens_per_s) with each step's pairs counted by
rebuilding the run's sampler from its config.yaml; TRL's from a callback (the device synchronised at both ends)
and the batches' attention masks; peak GPU memory (torch.cuda.max_memory_allocated, both); the first step's
time and the time from launch to the end of the first step; each step's loss and rewards/accuracies. --out gets
preference-<gpu>.json and each row's log.

On the GPU machine TRL needs trl, datasets, dill and multiprocess wheels next to DeepSpeed's (installed by the
env script into /tmp/site).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import sft  # the SFT benchmark's TRL launch and LoRA settings
from run_record import (bench_args, bench_parser, device_name, log, pick, rate, reuse_or_make_llama, run_dstrain, run_rows, short_name,
                        versions_in_child)

LLAMA32_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=8192,
                  tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=500000.0)
LLAMA_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024, tie_word_embeddings=True)
TOKENIZER_VOCAB = 32000
PROMPT = (100, 0.9)          # (median tokens, log-normal sigma): mean ~150
COMPLETION = (200, 0.67)     # mean ~250, chosen and rejected drawn independently
LORA_TARGETS = sft.LORA_TARGETS
LORA_R, LORA_ALPHA = sft.LORA_R, sft.LORA_ALPHA
LR_FULL, LR_LORA = 5e-6, 5e-5
BETA = 0.1
EVAL_FRACTION = 0.02
WARMUP_LR_STEPS = 0
TRL_MICRO_PAIRS = 4


# ---------------------------------------------------------------- setup: model, data

def make_pairs(directory: Path, pairs: int, seq_len: int, chars_per_token: float, tokenizer_dir: Path,
               seed: int = 0, scale: float = 1.0) -> dict:
    """pairs.jsonl (prompt/chosen/rejected) and measured.json (the token lengths as the tokenizer counts)."""
    import numpy as np
    from make_instruction_data import corpus_text, cut
    from transformers import AutoTokenizer

    rng = np.random.default_rng(seed)
    wanted, pairs = pairs, pairs + pairs // 20 + 8  # some spare: pairs whose tokens overrun the row are left out

    def lognormal(median_sigma, n):
        median, sigma = median_sigma
        return np.maximum(np.rint(rng.lognormal(np.log(median * scale), sigma, n)), 4).astype(int)

    prompt, chosen, rejected = lognormal(PROMPT, pairs), lognormal(COMPLETION, pairs), lognormal(COMPLETION, pairs)
    cap = int(0.9 * seq_len)
    prompt = np.minimum(prompt, cap // 4)
    for i in range(pairs):  # the longer completion gives way until the pair's two examples fit
        while 2 * prompt[i] + chosen[i] + rejected[i] > cap:
            if chosen[i] >= rejected[i]:
                chosen[i] = max(4, chosen[i] - (2 * prompt[i] + chosen[i] + rejected[i] - cap))
            else:
                rejected[i] = max(4, rejected[i] - (2 * prompt[i] + chosen[i] + rejected[i] - cap))
    text = corpus_text()
    cut_rng = np.random.default_rng(seed + 1)
    rows = []
    for i in range(pairs):
        row = {key: cut(text, cut_rng, int(round(n * chars_per_token))) or "x"
               for key, n in (("prompt", prompt[i]), ("chosen", chosen[i]), ("rejected", rejected[i]))}
        row["prompt"] += "\n"  # a token boundary: the prompt's tokens are a prefix of prompt + completion's (TRL)
        rows.append(row)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    p = [len(x) for x in tokenizer([r["prompt"] for r in rows])["input_ids"]]  # with <s>
    c = [len(x) + 1 for x in tokenizer([r["chosen"] for r in rows], add_special_tokens=False)["input_ids"]]  # + </s>
    r = [len(x) + 1 for x in tokenizer([r["rejected"] for r in rows], add_special_tokens=False)["input_ids"]]
    # the text's characters per token vary (code, tables): a pair that overruns the row in real tokens is left
    # out, so that dstrain neither cuts nor drops a pair and row i of the file is pair i of dstrain's data
    fits = [i for i in range(len(rows)) if 2 * p[i] + c[i] + r[i] <= seq_len - 8]
    keep = fits[:wanted]
    left_out = keep[-1] + 1 - len(keep)  # overrunning pairs among the rows up to the last one kept
    rows, p, c, r = [rows[i] for i in keep], [p[i] for i in keep], [c[i] for i in keep], [r[i] for i in keep]
    pairs = len(rows)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "pairs.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    pair = np.asarray([2 * a + b + d for a, b, d in zip(p, c, r)])
    from dstrain.data.binpack import pack_rows
    _, offsets = pack_rows(pair, seq_len, seed)
    example = sorted([a + b for a, b in zip(p, c)] + [a + d for a, d in zip(p, r)])
    summary = {"pairs": pairs, "seed": seed, "seq_len": seq_len,
               "follows": "UltraFeedback-like: prompt ~150, completion ~250 tokens, log-normal",
               "prompt_tokens_mean": float(np.mean(p)), "chosen_tokens_mean": float(np.mean(c)),
               "rejected_tokens_mean": float(np.mean(r)), "pair_tokens_mean": float(pair.mean()),
               "pair_tokens_p50_p90_p99_max": [int(np.percentile(pair, q)) for q in (50, 90, 99, 100)],
               "example_tokens_p50_p90_p99_max": [example[int(q * (len(example) - 1))] for q in (0.5, 0.9, 0.99, 1)],
               "pairs_over_seq_len": int((pair > seq_len).sum()), "overrunning_pairs_left_out": left_out,
               "pairs_per_packed_row": pairs / (len(offsets) - 1),
               "packed_row_fill": float(pair.sum()) / ((len(offsets) - 1) * seq_len),
               "padded_row_fill": float(np.mean(example)) / seq_len}
    (directory / "measured.json").write_text(json.dumps(summary, indent=2))
    return summary


# ---------------------------------------------------------------- dstrain rows

def dstrain_row(spec: dict, ctx: dict, args) -> dict:
    name = spec["name"]
    row = {k: spec[k] for k in ("name", "runner", "stage", "lora", "packed")}
    micro, accum = ctx["packed_micro"] if spec["packed"] else (TRL_MICRO_PAIRS, args.global_pairs // TRL_MICRO_PAIRS)
    reference = spec.get("reference", "adapters_off" if spec["lora"] else "model")
    sets = [f"model.name=hf:{ctx['model']}", "data.source=jsonl", "data.format=preference",
            f"data.paths=[{ctx['data'] / 'pairs.jsonl'}]", f"data.seq_len={args.seq_len}",
            f"data.packing={'true' if spec['packed'] else 'false'}", f"data.eval_fraction={EVAL_FRACTION}",
            f"data.cache_dir={args.work / 'dstrain-cache'}", "train.objective=dpo",
            f"train.micro_batch_size={micro}", f"train.grad_accum_steps={accum}", f"train.max_steps={args.steps}",
            f"train.warmup_steps={WARMUP_LR_STEPS}", "train.schedule=constant",
            f"train.lr={LR_LORA if spec['lora'] else LR_FULL}", "train.weight_decay=0.0", "train.betas=[0.9,0.999]",
            "train.grad_clip=1.0", f"train.seed={args.seed}", "preference.loss=sigmoid", f"preference.beta={BETA}",
            f"preference.reference={reference}",
            f"train.activation_checkpointing={'true' if spec.get('ac') else 'false'}"]
    if args.accelerator == "cuda":
        sets.append("train.precision=bf16")
    else:
        sets.append("model.kwargs.dtype=float32")
    if spec["lora"]:
        sets += [f"model.lora.r={LORA_R}", f"model.lora.alpha={LORA_ALPHA}",
                 f"model.lora.target_modules=[{','.join(LORA_TARGETS)}]"]
    launched = time.time()
    result, steps = run_dstrain(name, f"stage{spec['stage']}", sets, args)
    row.update(result, micro_batch=micro, grad_accum=accum, reference=reference,
               activation_checkpointing=bool(spec.get("ac")))
    if "error" in row:
        return row
    pairs = step_pairs(args.work / "runs" / name, len(steps))
    timed = [r for r in steps if r["step"] > args.warmup]
    seconds = sum(r["step_time_ms"] for r in timed) / 1000
    row.update({"pairs_per_s": sum(pairs[r["step"] - 1] for r in timed) / seconds,
                "real_tokens_per_s": rate(timed, "real_tokens_per_s"), "row_tokens_per_s": rate(timed),
                "pairs_per_step_mean": statistics.fmean(pairs[r["step"] - 1] for r in timed),
                "pairs_per_step": pairs, "step_s_median": statistics.median(r["step_time_ms"] for r in timed) / 1000,
                "timed_steps": len(timed), "peak_gpu_gib": max(r.get("memory_gib", 0.0) for r in steps),
                "first_step_s": steps[0]["step_time_ms"] / 1000,
                "launch_to_first_step_s": steps[0]["time"] - launched,
                "losses": [r["loss"] for r in steps],
                "accuracies": [r.get("rewards/accuracies") for r in steps],
                "margins": [r.get("rewards/margins") for r in steps],
                "logps_chosen": [r.get("logps/chosen") for r in steps]})
    return row


def step_pairs(run_dir: Path, steps: int) -> list[int]:
    """The pairs of each step: the run's own sampler, rebuilt from its resolved config (sample i is a pure
    function of the seed and i), over the samples the loop takes at step k: k x global .. (k + 1) x global."""
    import yaml
    from dstrain import rundir
    from dstrain.config.schema import RunConfig
    from dstrain.data import build_samplers

    config = RunConfig.model_validate(yaml.safe_load((run_dir / rundir.CONFIG).read_text()))
    train, _ = build_samplers(config)
    g = config.train.global_batch_size
    return [train.examples(k * g, g) for k in range(steps)]


# ---------------------------------------------------------------- TRL rows

def trl_row(spec: dict, ctx: dict, args) -> dict:
    child = {"model": str(ctx["model"]), "data": str(ctx["data"] / "pairs.jsonl"), "lora": spec["lora"],
             "gc": spec["gc"], "micro": TRL_MICRO_PAIRS, "accum": args.global_pairs // TRL_MICRO_PAIRS,
             "lr": LR_LORA if spec["lora"] else LR_FULL, "launched": time.time()}
    return {**{k: spec[k] for k in ("name", "runner", "stage", "lora", "packed")}, "deepspeed": True,
            "gradient_checkpointing_asked": spec["gc"], "micro_batch": TRL_MICRO_PAIRS,
            "grad_accum": args.global_pairs // TRL_MICRO_PAIRS,
            **sft.launch_trl(spec["name"], spec["stage"], child, Path(__file__).resolve(), args)}

def trl_child(spec_path: Path) -> None:
    """Inside accelerate's process: what a TRL user writes, plus counters and dstrain's pair order."""
    import numpy as np
    import torch
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers import TrainerCallback
    from trl import DPOConfig, DPOTrainer

    spec = json.loads(spec_path.read_text())
    rows = [json.loads(line) for line in Path(spec["data"]).read_text().splitlines()]
    # dstrain's unpacked order: its training pairs are the first int(n x (1 - eval_fraction)) rows, sample i is
    # pair perm[i] of the seeded permutation (dstrain/data/sampler.py SeededOrder, seed train.seed, epoch 0)
    n_train = int(len(rows) * (1.0 - EVAL_FRACTION))
    perm = np.random.default_rng([spec["seed"], 0]).permutation(n_train)
    needed = spec["steps"] * spec["micro"] * spec["accum"]
    order = [int(perm[i % n_train]) for i in range(needed)]
    dataset = Dataset.from_list([rows[i] for i in order])
    peft_config = None
    if spec["lora"]:
        from peft import LoraConfig
        peft_config = LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=LORA_TARGETS,
                                 task_type="CAUSAL_LM")
    config = DPOConfig(output_dir=spec["output_dir"], per_device_train_batch_size=spec["micro"],
                       gradient_accumulation_steps=spec["accum"], max_steps=spec["steps"], learning_rate=spec["lr"],
                       lr_scheduler_type="constant", warmup_steps=WARMUP_LR_STEPS, max_length=spec["seq_len"],
                       beta=BETA, loss_type=["sigmoid"], logging_steps=1, save_strategy="no", report_to="none",
                       gradient_checkpointing=spec["gc"], bf16=spec["cuda"], seed=spec["seed"], disable_tqdm=True,
                       use_cpu=not spec["cuda"], dataloader_drop_last=True,
                       model_init_kwargs={"dtype": torch.bfloat16 if spec["cuda"] else torch.float32})

    class Counting(DPOTrainer):
        real_tokens = pairs = 0

        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)  # the dataset is already in dstrain's order

        def compute_loss(self, model, inputs, *rest, **kwargs):
            if model.training:
                Counting.real_tokens += int(inputs["attention_mask"].sum())
                Counting.pairs += inputs["input_ids"].size(0) // 2
            return super().compute_loss(model, inputs, *rest, **kwargs)

    def sync():
        if spec["cuda"]:
            torch.cuda.synchronize()

    class Timer(TrainerCallback):
        def __init__(self):
            self.marks, self.logs, self.step_ends, self.begin = {}, [], [], None

        def on_train_begin(self, args, state, control, **kwargs):
            sync()
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step in (1, spec["warmup"], spec["steps"]):
                sync()
                self.marks[state.global_step] = (time.perf_counter(), time.time(), Counting.real_tokens,
                                                 Counting.pairs)
            self.step_ends.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.logs.append(dict(logs))

    timer = Timer()
    trainer = Counting(model=spec["model"], args=config, train_dataset=dataset, peft_config=peft_config,
                       callbacks=[timer])
    if spec["cuda"]:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    if trainer.accelerator.is_main_process:
        (t0, _, real0, pairs0), (t1, _, real1, pairs1) = timer.marks[spec["warmup"]], timer.marks[spec["steps"]]
        gaps = [b - a for a, b in zip(timer.step_ends[spec["warmup"] - 1:], timer.step_ends[spec["warmup"]:])]
        Path(spec["result"]).write_text(json.dumps({
            "pairs_per_s": (pairs1 - pairs0) / (t1 - t0), "real_tokens_per_s": (real1 - real0) / (t1 - t0),
            "real_tokens_source": "batches: attention-mask sum", "pairs_per_step_mean": (pairs1 - pairs0) / (
                spec["steps"] - spec["warmup"]),
            "step_s_median": statistics.median(gaps) if gaps else None, "timed_steps": spec["steps"] - spec["warmup"],
            "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if spec["cuda"] else None,
            "first_step_s": timer.marks[1][0] - timer.begin,
            "launch_to_first_step_s": timer.marks[1][1] - spec["launched"],
            "losses": [entry["loss"] for entry in timer.logs],
            "accuracies": [entry.get("rewards/accuracies") for entry in timer.logs],
            "margins": [entry.get("rewards/margins") for entry in timer.logs],
            "logps_chosen": [entry.get("logps/chosen") for entry in timer.logs],
            "attn_implementation": getattr(trainer.model.config, "_attn_implementation", None),
            "gradient_checkpointing": bool(getattr(trainer.model, "is_gradient_checkpointing", False))}))


# ---------------------------------------------------------------- plan, report

ROWS = [  # in the order run (most wanted first: a cut-off call loses the tail)
    {"name": "dstrain-z3-full-packed", "runner": "dstrain", "stage": 3, "lora": False, "packed": True},
    {"name": "trl-z3-full-nogc", "runner": "trl", "stage": 3, "lora": False, "packed": False, "gc": False},
    {"name": "dstrain-z3-full-unpacked", "runner": "dstrain", "stage": 3, "lora": False, "packed": False},
    {"name": "trl-z3-full-gc", "runner": "trl", "stage": 3, "lora": False, "packed": False, "gc": True},
    {"name": "dstrain-z2-lora-packed", "runner": "dstrain", "stage": 2, "lora": True, "packed": True},
    {"name": "trl-z2-lora-gc", "runner": "trl", "stage": 2, "lora": True, "packed": False, "gc": True},
    {"name": "dstrain-z3-full-packed-precomputed", "runner": "dstrain", "stage": 3, "lora": False, "packed": True,
     "reference": "precomputed"},
    {"name": "dstrain-z3-full-packed-ac", "runner": "dstrain", "stage": 3, "lora": False, "packed": True, "ac": True},
    {"name": "dstrain-z3-full-packed-precomputed-ac", "runner": "dstrain", "stage": 3, "lora": False,
     "packed": True, "reference": "precomputed", "ac": True},
    {"name": "trl-z2-lora-nogc", "runner": "trl", "stage": 2, "lora": True, "packed": False, "gc": False},
]
PEER = {"dstrain-z3-full-packed": "trl-z3-full-nogc", "dstrain-z3-full-unpacked": "trl-z3-full-nogc",
        "dstrain-z3-full-packed-ac": "trl-z3-full-gc", "dstrain-z2-lora-packed": "trl-z2-lora-nogc",
        "dstrain-z3-full-packed-precomputed": "trl-z3-full-nogc", "dstrain-z3-full-packed-precomputed-ac": "trl-z3-full-gc"}


def plan_rows(args) -> list[dict]:
    return pick([r for r in ROWS if r["runner"] == "dstrain" or not args.tiny or args.trl_tiny], args.rows)


def table(rows: list[dict]) -> str:
    lines = [f"{'row':36} {'pairs/s':>8} {'real tok/s':>10} {'peak GiB':>8} {'1st step s':>10} {'launch>1st s':>12} "
             f"{'pairs/step':>10} {'vs peer':>16} {'vs unpacked':>11}"]
    by_name = {r["name"]: r for r in rows}
    for r in rows:
        if "error" in r:
            lines.append(f"{r['name']:36} failed: {r['error'].strip().splitlines()[0][:110] if r['error'].strip() else ''}")
            continue
        peer = by_name.get(PEER.get(r["name"], ""), {})
        vs_peer = (f"{r['pairs_per_s'] / peer['pairs_per_s']:.2f}x {peer['name'].split('-')[-1]}"
                   if peer.get("pairs_per_s") else "")
        if r["name"] == "dstrain-z2-lora-packed" and not vs_peer and by_name.get("trl-z2-lora-gc", {}).get("pairs_per_s"):
            vs_peer = f"{r['pairs_per_s'] / by_name['trl-z2-lora-gc']['pairs_per_s']:.2f}x gc"
        unpacked = by_name.get("dstrain-z3-full-unpacked", {})
        vs_unpacked = (f"{r['pairs_per_s'] / unpacked['pairs_per_s']:.2f}x"
                       if r["name"] == "dstrain-z3-full-packed" and unpacked.get("pairs_per_s") else "")
        memory = f"{r['peak_gpu_gib']:.1f}" if r.get("peak_gpu_gib") is not None else "-"
        lines.append(f"{r['name']:36} {r['pairs_per_s']:>8.2f} {r['real_tokens_per_s']:>10,.0f} {memory:>8} "
                     f"{r['first_step_s']:>10.1f} {r['launch_to_first_step_s']:>12.1f} {r['pairs_per_step_mean']:>10.1f} "
                     f"{vs_peer:>16} {vs_unpacked:>11}")
    return "\n".join(lines)


def curves(rows: list[dict], first: int = 30) -> str:
    """Loss and reward accuracy per step, one line per row."""
    out = []
    for r in rows:
        if "losses" not in r:
            continue
        out.append(f"{r['name']:36} loss " + " ".join(f"{x:.4f}" for x in r["losses"][:first]))
        out.append(f"{'':36} acc  " + " ".join("  -   " if x is None else f"{x:.3f} " for x in r["accuracies"][:first]))
    by_name = {r["name"]: r for r in rows}
    unpacked = by_name.get("dstrain-z3-full-unpacked", {})
    for peer in ("trl-z3-full-nogc", "trl-z3-full-gc"):  # the same pairs in the same micro batches: the same log-probs
        if unpacked.get("logps_chosen") and by_name.get(peer, {}).get("logps_chosen"):
            out.append(f"same order check, logps/chosen steps 1-3: dstrain-z3-full-unpacked "
                       f"{[round(x, 1) for x in unpacked['logps_chosen'][:3]]}, {peer} "
                       f"{[round(x, 1) for x in by_name[peer]['logps_chosen'][:3]]}")
    return "\n".join(out)


DEFAULTS = {"steps": (24, 3), "warmup": (4, 1), "seq_len": (2048, 256), "global_pairs": (16, 8),
            "pairs": (4000, 200), "row_timeout": (150.0, 900.0), "budget": (560.0, 3600.0)}


def main() -> None:
    parser = bench_parser(__doc__, DEFAULTS)
    parser.add_argument("--trl-tiny", action="store_true", help="with --tiny: the TRL rows too")
    args = bench_args(parser, DEFAULTS, "pref")
    if args.command == "trl-child":
        trl_child(args.spec)
        return
    if args.global_pairs % TRL_MICRO_PAIRS:
        parser.error(f"--global-pairs must be a multiple of {TRL_MICRO_PAIRS}")
    tiny = args.tiny
    log(f"work {args.work}; out {args.out}")

    model_dir, data_dir = args.work / "model", args.work / "data"
    # the tokenizer's 32,000 ids; the embedding and the head keep Llama-3.2's 128,256 rows (the head's cost there)
    facts = reuse_or_make_llama(model_dir, LLAMA_TINY if tiny else LLAMA32_1B,
                                tokenizer_vocab=LLAMA_TINY["vocab_size"] if tiny else TOKENIZER_VOCAB,
                                text_chars=(1 if tiny else 6) * 1_000_000)
    lengths = make_pairs(data_dir, args.pairs, args.seq_len, facts["chars_per_token"], model_dir,
                         scale=0.15 if tiny else 1.0)
    log(f"data: {json.dumps(lengths)}")
    per_row = lengths["pairs_per_packed_row"]
    rows_a_step = max(2, 2 * round(args.global_pairs / per_row / 2))  # the nearest even number of rows
    packed_micro = (rows_a_step // 2, 2)  # (rows a micro batch, micro batches a step)
    log(f"packed: {per_row:.2f} pairs a row -> {packed_micro[0]} rows x {packed_micro[1]} micro batches a step "
        f"(~{packed_micro[0] * packed_micro[1] * per_row:.1f} pairs; unpacked and TRL: {args.global_pairs})")
    ctx = {"model": model_dir, "data": data_dir, "lengths": lengths, "packed_micro": packed_micro}

    device = device_name(args.accelerator == "cuda")
    doc = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": device,
           "versions": versions_in_child(), "model": facts, "data": lengths, "packed_micro": packed_micro,
           "settings": {k: str(v) for k, v in vars(args).items()}, "rows": []}

    def run_one(spec: dict) -> dict:
        return dstrain_row(spec, ctx, args) if spec["runner"] == "dstrain" else trl_row(spec, ctx, args)

    def describe(row: dict) -> str:
        return (f"{row['pairs_per_s']:.2f} pairs/s, {row['real_tokens_per_s']:,.0f} real tok/s, peak "
                f"{row['peak_gpu_gib']} GiB, losses {[round(x, 4) for x in row['losses'][:6]]}, {row['wall_s']}s")
    run_rows(plan_rows(args), run_one, describe, doc, args.out / f"preference-{short_name(device)}.json", args,
             order=[r["name"] for r in ROWS])
    print("\n" + table(doc["rows"]) + "\n\n" + curves(doc["rows"]), flush=True)


if __name__ == "__main__":
    main()
