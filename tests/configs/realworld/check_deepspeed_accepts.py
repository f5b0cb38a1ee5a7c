"""Check which corpus configs DeepSpeed itself accepts, the way its engine reads them.

For every *.json in this folder:
  1. parse it as DeepSpeed parses a config path (hjson, duplicate keys refused),
     and note whether strict JSON (json.loads) also parses it;
  2. replace each "auto" with a concrete value of the right type, as the Hugging Face
     Trainer would (batch keys consistent with a data-parallel world of 2 ranks);
  3. build deepspeed.runtime.config.DeepSpeedConfig(cfg, mpu=<world 2>) in one gloo
     process, which runs DeepSpeed's config models, batch arithmetic and sanity checks.

A file whose three batch keys are all fixed by its authors for a bigger cluster is
refused at world 2 for batch arithmetic alone; it is then tried again at the world
size its numbers imply, and the table says so.

Usage (from the repository root, in the project venv):
    python tests/configs/realworld/check_deepspeed_accepts.py [--markdown] [--write]
Prints one row per file: file, strict JSON, accepted, DeepSpeed's error (first line).
With --write, also records the verdicts in deepspeed_verdicts.json beside the files: the
fast lane (tests/test_config_realworld.py) checks dstrain's verdict against it on every file.
"""

import json
import logging
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORLD = 2
MICRO = 2
HIDDEN = 1024  # model hidden size the HF Trainer would read to fill bucket sizes

# "auto" values the Hugging Face Trainer fills, keyed by the key's own name.
AUTO_BY_KEY = {
    "lr": 1e-4,
    "betas": [0.9, 0.999],
    "eps": 1e-8,
    "weight_decay": 0.0,
    "warmup_min_lr": 0.0,
    "warmup_max_lr": 1e-4,
    "warmup_num_steps": 10,
    "total_num_steps": 100,
    "gradient_clipping": 1.0,
    "reduce_bucket_size": HIDDEN * HIDDEN,
    "stage3_prefetch_bucket_size": int(0.9 * HIDDEN * HIDDEN),
    "stage3_param_persistence_threshold": 10 * HIDDEN,
    "opt_level": "O1",
    "stage3_gather_16bit_weights_on_model_save": False,  # Accelerate: zero3_save_16bit_model
}


class DataParallelWorld:
    """The smallest Megatron-style mpu DeepSpeedConfig asks for its world size."""

    def __init__(self, size):
        self.size = size

    def get_data_parallel_world_size(self):
        return self.size


def read_like_deepspeed(path):
    """Parse as DeepSpeedConfig does for a path; also report strict-JSON validity."""
    import hjson
    from deepspeed.runtime.config_utils import dict_raise_error_on_duplicate_keys

    text = path.read_text()
    try:
        json.loads(text)
        strict = "yes"
    except json.JSONDecodeError as err:
        strict = f"no ({err.msg}, line {err.lineno})"
    with open(path) as handle:
        cfg = hjson.load(handle, object_pairs_hook=dict_raise_error_on_duplicate_keys)
    return strict, cfg


def precision_choice(cfg):
    """Which of fp16/bf16 an "auto" enables: bf16 unless the file fixes fp16 on."""
    fp16 = cfg.get("fp16", {}) if isinstance(cfg.get("fp16"), dict) else {}
    return "fp16" if fp16.get("enabled") is True else "bf16"


def fill_autos(node, choice, unknown, key_path=""):
    """Replace every "auto" below node in place; collect ones with no rule."""
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for key, value in list(items):
        here = f"{key_path}.{key}" if key_path else str(key)
        if isinstance(value, (dict, list)):
            fill_autos(value, choice, unknown, here)
        elif value == "auto":
            section = key_path.split(".")[-1] if key_path else ""
            if key == "enabled" and section in ("fp16", "bf16", "bfloat16"):
                node[key] = (section == "fp16") == (choice == "fp16")
            elif key == "enabled" and section == "amp":
                node[key] = False
            elif key in AUTO_BY_KEY:
                node[key] = AUTO_BY_KEY[key]
            elif key not in (
                "train_batch_size",
                "train_micro_batch_size_per_gpu",
                "gradient_accumulation_steps",
            ):
                unknown.append(here)


def fill_batch(cfg):
    """Batch keys as the Trainer sets them: micro x accumulation x world.

    A file with no batch size at all leaves it to the wrapper (Trainer, Lightning,
    dstrain), which passes one; we add the micro batch and say so. Returns that note.
    """
    if "train_batch_size" not in cfg and "train_micro_batch_size_per_gpu" not in cfg:
        cfg["train_micro_batch_size_per_gpu"] = MICRO
        note = f"file sets no batch size; checked with train_micro_batch_size_per_gpu={MICRO} added"
    else:
        note = ""
    if cfg.get("train_micro_batch_size_per_gpu") == "auto":
        cfg["train_micro_batch_size_per_gpu"] = MICRO
    if cfg.get("gradient_accumulation_steps") == "auto":
        cfg["gradient_accumulation_steps"] = 1
    if cfg.get("train_batch_size") == "auto":
        micro = cfg.get("train_micro_batch_size_per_gpu", MICRO)
        accum = cfg.get("gradient_accumulation_steps", 1)
        if isinstance(micro, int) and isinstance(accum, int):
            cfg["train_batch_size"] = micro * accum * WORLD
        else:  # a quoted number ("8"): leave the arithmetic to DeepSpeed
            cfg.pop("train_batch_size")
    return note


def implied_world(cfg):
    """World size a file's three fixed batch keys were written for, or None."""
    keys = (
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
    )
    values = [cfg.get(k) for k in keys]
    if not all(isinstance(v, int) for v in values):
        return None
    train, micro, accum = values
    if (
        micro * accum
        and train % (micro * accum) == 0
        and train // (micro * accum) != WORLD
    ):
        return train // (micro * accum)
    return None


def is_batch_arithmetic(error):
    """DeepSpeed's refusals that depend only on the world size the batch keys meet."""
    return (
        "Check batch related parameters" in error or "has to be greater than 0" in error
    )


def deepspeed_verdict(cfg, world):
    """None when DeepSpeedConfig accepts cfg at this world size, else its error."""
    from deepspeed.runtime.config import DeepSpeedConfig

    try:
        DeepSpeedConfig(json.loads(json.dumps(cfg)), mpu=DataParallelWorld(world))
        return None
    except Exception as err:  # noqa: BLE001 - DeepSpeed raises many types; its message is the fact
        lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
        lines = [
            line for line in lines if not line.startswith("For further information")
        ]
        return f"{type(err).__name__}: {' / '.join(lines)}"[:400]


def check(path):
    """One table row for one file."""
    try:
        strict, cfg = read_like_deepspeed(path)
    except (
        ValueError,
        OSError,
    ) as err:  # hjson syntax errors and duplicate keys are ValueErrors
        return (
            path.name,
            "no",
            "no",
            f"parse: {type(err).__name__}: {str(err).splitlines()[0]}"[:300],
        )
    unknown = []
    fill_autos(cfg, precision_choice(cfg), unknown)
    note = fill_batch(cfg)
    error = deepspeed_verdict(cfg, WORLD)
    accepted = "yes" if error is None else "no"
    if error and is_batch_arithmetic(error):
        for world in (implied_world(cfg), 1):
            if world and deepspeed_verdict(cfg, world) is None:
                accepted, error = f"at world {world} only", f"(world {WORLD}) {error}"
                break
    if unknown:
        error = f"{error or ''} [no rule for auto at: {', '.join(unknown)}]".strip()
    if note:
        error = f"{error or ''} [{note}]".strip()
    return path.name, strict, accepted, error or ""


def start_one_rank():
    """A gloo process group of one rank, so DeepSpeedConfig asks the mpu for world size."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    import deepspeed
    from dstrain.rank.runtime import skip_shared_memory_all_reduce_op

    skip_shared_memory_all_reduce_op()  # as dstrain's ranks: an op only AutoTP's inference_all_reduce calls
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)


def main():
    logging.disable(logging.WARNING)
    start_one_rank()
    logging.disable(logging.CRITICAL)
    rows = [check(p) for p in sorted(HERE.glob("*.json"))]
    markdown = "--markdown" in sys.argv
    for name, strict, accepted, error in rows:
        if markdown:
            print(f"| {name} | {strict} | {accepted} | {error.replace('|', '/')} |")
        else:
            print(f"{name}\t{strict}\t{accepted}\t{error}")
    refused = sum(1 for r in rows if r[2] == "no")
    elsewhere = sum(1 for r in rows if r[2].startswith("at world"))
    version = __import__("deepspeed").__version__
    if "--write" in sys.argv:
        verdicts = {"deepspeed": version, "torch": __import__("torch").__version__, "world": WORLD,
                    "files": {name: {"accepted": accepted, "error": error} for name, _, accepted, error in rows}}
        (HERE / "deepspeed_verdicts.json").write_text(json.dumps(verdicts, indent=1, sort_keys=True) + "\n")
    print(
        f"# {len(rows)} files, DeepSpeed {version}: {len(rows) - refused - elsewhere} accepted at world {WORLD}, "
        f"{elsewhere} accepted only at another world size, {refused} refused"
    )


if __name__ == "__main__":
    main()
