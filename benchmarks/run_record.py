"""What the benchmark scripts beside it share (they run as files and import it): the record every script
writes (date, host, device, versions), the `dstrain run` of a row and its metrics, a logged child process
with a time limit, the carried wheels a GPU machine lacks, and the random-weight Llama folders the fine-tuning
benchmarks train. `python3 benchmarks/run_record.py` prints the versions as this interpreter sees them."""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("torch", "deepspeed", "transformers", "peft", "flash-attn", "lightning", "trl", "accelerate",
            "datasets", "tokenizers", "torchao", "dstrain")
T0 = time.time()
# TinyLlama's shape: a ~1.1B Llama-style model (the fine-tuning and long-sequence benchmarks)
LLAMA_1B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S', time.gmtime())} +{time.time() - T0:6.0f}s] {message}", flush=True)


def versions(packages: tuple[str, ...] = PACKAGES) -> dict:
    """Python's and each package's installed version (None where it is not installed), and the commit."""
    import importlib.metadata as md
    out = {"python": platform.python_version()}
    for package in packages:
        try:
            out[package] = md.version(package)
        except md.PackageNotFoundError:
            out[package] = None
    try:
        import torch
        out["cuda"] = torch.version.cuda
    except ImportError:
        pass
    # --dirty: a copied working tree (the GPU machine's) can carry stale git metadata
    commit = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True, text=True)
    out["dstrain_commit"] = commit.stdout.strip() or os.environ.get("DSTRAIN_COMMIT")
    return out


def versions_in_child() -> dict:
    """The versions as the rows see them (PYTHONPATH with /tmp/site, where wheels installed later went)."""
    done = subprocess.run([sys.executable, __file__], capture_output=True, text=True)
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return versions()


def device_name(cuda: bool) -> str:
    import torch
    return torch.cuda.get_device_name(0) if cuda and torch.cuda.is_available() else "cpu"


def short_name(device: str) -> str:
    """For file names: "NVIDIA H100 80GB HBM3" -> h100; "cpu" stays."""
    found = re.search(r"\b([A-Z]\d{2,4}[A-Z]?)\b", device)
    return found.group(1).lower() if found else "cpu" if device == "cpu" else "gpu"


def write_json(path: Path, settings: dict, rows: list[dict], quiet: bool = False) -> None:
    """The run's record: when, where (host and GPU), the versions, the settings and every row."""
    import torch
    path.write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "host": platform.node(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "versions": versions(), "settings": {k: str(v) for k, v in settings.items()}, "rows": rows},
        indent=2) + "\n")
    if not quiet:
        print(f"written to {path}")


def bench_parser(doc: str, defaults: dict[str, tuple]) -> argparse.ArgumentParser:
    """The arguments sft.py, preference.py and fp8.py share; `defaults` maps each numeric one to (its default,
    its --tiny default), for bench_args to fill in."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", default="bench", choices=["bench", "trl-child"])
    parser.add_argument("--spec", type=Path, help="trl-child: its spec file")
    parser.add_argument("--out", type=Path, default=os.environ.get("OUT"), help="the JSON and the logs (default $OUT, "
                        "else WORK/out)")
    parser.add_argument("--work", type=Path, default=None, help="model, data and runs, reused (default a temp folder)")
    parser.add_argument("--rows", default=None, help="comma-separated row names or globs, e.g. 'z3-*'")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: a tiny Llama, short rows, few steps")
    parser.add_argument("--accelerator", choices=("cuda", "cpu"), default=None, help="default cuda; --tiny cpu")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--dstrain-set", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting for every dstrain row, after the row's own, e.g. "
                             "model.kwargs.attn_implementation=flex_attention (repeatable)")
    for key, (full, tiny) in defaults.items():
        parser.add_argument("--" + key.replace("_", "-"), type=type(full), default=None,
                            help=f"default {full}; --tiny {tiny}")
    return parser


def bench_args(parser: argparse.ArgumentParser, defaults: dict[str, tuple], name: str) -> argparse.Namespace:
    """bench_parser's arguments with the defaults filled in and the output folder made."""
    args = parser.parse_args()
    if args.command != "bench":
        return args
    for key, (full, tiny) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, tiny if args.tiny else full)
    if args.warmup >= args.steps:
        parser.error("--warmup must be below --steps")
    args.accelerator = args.accelerator or ("cpu" if args.tiny else "cuda")
    args.work = Path(args.work or Path(tempfile.gettempdir()) / (f"dstrain-{name}" + ("-tiny" if args.tiny else "")))
    args.out = Path(args.out or args.work / "out")
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def run_rows(planned: list[dict], run_one, describe, doc: dict, out_file: Path, args, order=None, after=None):
    """Each planned row (a dict with its "name") through run_one(spec) -> row, each within --row-timeout, all
    within --budget seconds of the start (a row that would start later is recorded as skipped: a device call
    has a hard end); the results file is written after every row, so a cut-off call keeps what it measured,
    and a partial re-run (--rows) keeps the earlier rows it does not repeat. `after(rows)` adds derived figures."""
    names = {spec["name"] for spec in planned}
    if out_file.exists():
        doc["rows"] = [r for r in json.loads(out_file.read_text()).get("rows", []) if r["name"] not in names]
    log(f"{len(planned)} rows: {', '.join(spec['name'] for spec in planned)}")
    for spec in planned:
        name, base = spec["name"], {k: spec[k] for k in ("name", "runner", "stage", "lora", "packed") if k in spec}
        left = args.budget - (time.time() - T0)
        if left < 60:
            log(f"row {name}: skipped, {args.budget:.0f}s budget spent")
            doc["rows"].append({**base, "error": f"skipped: the {args.budget:.0f}s budget (--budget) was spent"})
            continue
        args.row_limit = min(args.row_timeout, left)
        log(f"row {name}: start (at most {args.row_limit:.0f}s)")
        try:
            row = run_one(spec)
        except Exception as err:  # noqa: BLE001 - one broken row must not lose the others
            row = {**base, "error": f"{type(err).__name__}: {err}"}
        row["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        doc["rows"].append(row)
        if after:
            after(doc["rows"])
        out_file.write_text(json.dumps(doc, indent=2) + "\n")
        log(f"row {name}: " + (f"FAILED after {row.get('wall_s', '?')}s: {row['error'][-600:]}" if "error" in row
                               else describe(row)))
    if order:
        doc["rows"].sort(key=lambda r: order.index(r["name"]) if r["name"] in order else len(order))
        out_file.write_text(json.dumps(doc, indent=2) + "\n")
    log(f"written to {out_file}")


def dstrain_command(preset: str, gpus: int, accelerator: str, run_dir: Path, sets: list[str]) -> list[str]:
    """A row's `dstrain run`: the real launcher and worker."""
    command = [sys.executable, "-m", "dstrain.cli", "run", "--preset", preset, "--gpus", str(gpus),
               "--accelerator", accelerator, "--run-dir", str(run_dir)]
    return command + [part for item in sets for part in ("--set", item)]


def metrics(run_dir: Path) -> list[dict]:
    """The run's metrics.jsonl records (none when the run wrote none)."""
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


# What every fine-tuning benchmark row sets: a record every step, no checkpoint, evaluation only at the end
ROW_SETS = ["train.log_every=1", "train.save_checkpoints=false", "train.eval_every=1000000", "train.eval_batches=1"]


def run_dstrain(name: str, preset: str, sets: list[str], args) -> tuple[dict, list[dict]]:
    """One row's `dstrain run` on args.gpus GPUs (one where args has no gpus; run directory WORK/runs/NAME, its
    output OUT/logs/NAME.log), with the row's `sets` and then every --dstrain-set, within args.row_limit seconds:
    the row's wall time and command (and its error when it trained no step), and the run's per-step records."""
    run_dir = args.work / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    command = dstrain_command(preset, getattr(args, "gpus", 1), args.accelerator, run_dir,
                              ROW_SETS + sets + args.dstrain_set)
    code, wall, tail = run_logged(command, args.out / "logs" / f"{name}.log", args.row_limit)
    row = {"wall_s": round(wall, 1), "command": " ".join(command)}
    steps = [r for r in metrics(run_dir) if "loss" in r and "step_time_ms" in r]
    if code or not steps:
        row["error"] = f"exit {code}: {tail[-1500:]}"
    return row, steps


def rate(steps: list[dict], key: str = "tokens_per_s") -> float:
    """A per-second figure over these steps: their total (each step's rate x its time) over their time."""
    return sum(r[key] * r["step_time_ms"] for r in steps) / sum(r["step_time_ms"] for r in steps)


def pick(rows: list[dict], wanted: str | None) -> list[dict]:
    """The rows whose names match --rows: comma-separated names or globs (a row's whole name matches that row
    alone; another bare word matches inside names)."""
    if not wanted:
        return rows
    names = {r["name"] for r in rows}
    patterns = [p if p in names or any(c in p for c in "*?[") else f"*{p}*" for p in wanted.split(",")]
    return [r for r in rows if any(fnmatch.fnmatch(r["name"], p) for p in patterns)]


def run_logged(command: list[str], log_path: Path, timeout: float, cwd: Path = REPO) -> tuple[int, float, str]:
    """Run `command`, its output to `log_path` (a progress line every minute), killed with its process group
    after `timeout` seconds (exit 124); returns (exit code, seconds, the output's tail)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(REPO)) if p)
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
    return code, time.perf_counter() - started, log_path.read_text(errors="replace")[-3000:]


def install_wheels(pattern: str, wanted: tuple[str, ...]) -> str:
    """On the GPU machine: the carried wheels matching `pattern` under .whl/ into /tmp/site (on PYTHONPATH via
    gpu_env.sh), unless every module in `wanted` is importable already. datasets' wheel is picked by pyarrow."""
    import importlib.util
    if all(importlib.util.find_spec(name) for name in wanted):
        return "already importable"
    wheels = sorted((REPO / ".whl").glob(pattern))
    if not wheels:
        return f"not installed and no .whl/{pattern}"
    try:
        import importlib.metadata as md
        arrow = int(md.version("pyarrow").split(".")[0])
    except Exception:  # noqa: BLE001 - no pyarrow: datasets cannot work either way
        arrow = 0
    wheels = [w for w in wheels if not w.name.startswith("datasets-")
              or w.name.startswith("datasets-5" if arrow >= 24 else "datasets-4")]
    said = []
    for wheel in wheels:  # one at a time: a wheel that does not install does not take the others with it
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                               "--no-compile", "--target", "/tmp/site", str(wheel)], capture_output=True, text=True)
        said.append(wheel.name + ("" if done.returncode == 0 else f" FAILED: {done.stderr.strip()[-300:]}"))
    if "/tmp/site" not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in ("/tmp/site", os.environ.get("PYTHONPATH")) if p)
    return "installed into /tmp/site: " + "; ".join(said)


def install_trl() -> str:
    """TRL, datasets, dill and multiprocess from .whl/extra (the GPU image lacks them)."""
    return install_wheels("extra/*.whl", ("trl", "datasets"))


def build_tokenizer(directory: Path, vocab: int, text: str) -> float:
    """A Llama-like fast tokenizer (byte-level BPE, <s> before every text, </s> end, <pad>) trained on
    `text`; returns its characters per token on that text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator([text[i:i + 4096] for i in range(0, len(text), 4096)], trainer)
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", bpe.token_to_id("<s>"))])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>", pad_token="<pad>", model_max_length=1 << 20)
    tokenizer.save_pretrained(directory)
    sample = text[:200_000]
    return len(sample) / len(tokenizer(sample, add_special_tokens=False)["input_ids"])


def make_llama(directory: Path, shape: dict, tokenizer_vocab: int | None = None, text_chars: int = 6_000_000,
               **facts) -> dict:
    """A Llama folder with random weights in bf16 safetensors (initialised on the GPU where there is one:
    fast for billions of weights), with a tokenizer of `tokenizer_vocab` tokens trained on dstrain's corpus
    when given; bench_facts.json (and the returned facts) say what it is, so a later call reuses it."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    directory.mkdir(parents=True, exist_ok=True)
    if tokenizer_vocab:
        from make_instruction_data import corpus_text
        facts.update(tokenizer_vocab=tokenizer_vocab,
                     chars_per_token=build_tokenizer(directory, tokenizer_vocab, corpus_text()[:text_chars]))
    torch.manual_seed(0)
    config = LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=3)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory, max_shard_size="2GB")
    facts.update(params=sum(p.numel() for p in model.parameters()), shape=shape)
    del model
    torch.cuda.empty_cache()  # this process's allocator must not keep the weights' memory from the rows
    (directory / "bench_facts.json").write_text(json.dumps(facts, indent=2))
    log(f"model: {facts['params'] / 1e9:.3f}B parameters in {directory}")
    return facts


def reuse_or_make_llama(directory: Path, shape: dict, **kwargs) -> dict:
    """make_llama's facts, from the folder when it already holds a model of this shape."""
    facts_file = directory / "bench_facts.json"
    if facts_file.exists():
        facts = json.loads(facts_file.read_text())
        if facts.get("shape") == shape and all(facts.get(k) == v for k, v in kwargs.items() if k != "text_chars"):
            log(f"model reused: {directory}")
            return facts
    log("building the model (random weights, bf16 safetensors)" + (" and its tokenizer" if kwargs.get("tokenizer_vocab") else ""))
    return make_llama(directory, shape, **kwargs)


if __name__ == "__main__":
    print(json.dumps(versions()))
