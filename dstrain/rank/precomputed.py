"""preference.reference precomputed (DPO): each pair's reference log-prob sums, computed once with the
starting weights and cached on disk, so that training builds no reference model and runs no reference forward.

When. Before a checkpoint is loaded (training, a resume, `dstrain eval`): the weights are then the starting
ones (pretrained, train.init_from, LoRA adapters that change nothing yet), which are the reference.

How. The run's own ranks run one no-grad pass over every pair of the train and eval splits (each split's
rows once, in contiguous shares; every rank runs the same number of forwards, as ZeRO-3's gathers need),
in eval mode (no dropout, as the "model" reference). Each rank fills the pairs it saw into a [groups, 2]
tensor, one all-reduce (sum) gives every rank all of them; rank 0 writes the cache file atomically (a
temporary file renamed), then a barrier.

Cache. <data.cache_dir>/reference/<key>.npy, the key a hash of: the tokenized data's key
(dstrain.data.tokenized.cache_key), the model's identity (model.name; for an hf: folder its config.json and
its weight files' names, sizes and mtimes; the built-in model's section and train.seed), model.lora,
train.init_from (and its file's size and mtime), model.kwargs, the 16-bit dtype, the objective and
data.packing. Every rank looks for the file and the ranks agree (an all-reduce) before reading it, so
that ranks on nodes with different caches never split into some computing and some not.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

CACHE_VERSION = 1
SUBDIR = "reference"


def _file_facts(path: Path) -> list:
    stat = path.stat()
    return [path.name, stat.st_size, stat.st_mtime_ns]


def cache_key(config, ds_config: dict) -> str:
    """The hash naming this run's precomputed reference (see the module docstring)."""
    from dstrain.data import data_config
    from dstrain.data.formats import load_encoder
    from dstrain.data.tokenized import cache_key as data_key
    from dstrain.models import hf
    data = data_config(config)
    model = {"name": config.model.name}
    if hf.is_hf(config.model.name):
        source = Path(hf.source_of(config))
        if source.is_dir():
            model["config"] = hashlib.sha256((source / "config.json").read_bytes()).hexdigest()
            model["weights"] = [_file_facts(path) for path in hf.weight_files(config)]
    else:
        model["section"] = config.model.model_dump(mode="json")
        model["seed"] = config.train.seed
    init_from = config.train.init_from
    facts = {"version": CACHE_VERSION, "data": data_key(data, load_encoder(data)), "model": model,
             "lora": config.model.lora.model_dump(mode="json") if config.model.lora else None,
             "init_from": [str(init_from), *(_file_facts(Path(init_from)) if Path(init_from).is_file() else [])]
             if init_from else None,
             "kwargs": dict(config.model.kwargs),
             "dtype": [name for name in ("bf16", "fp16") if (ds_config.get(name) or {}).get("enabled")],
             "objective": config.train.objective, "packing": config.data.packing}
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def cache_path(config, ds_config: dict) -> Path:
    from dstrain.data import data_config
    from dstrain.data.tokenized import cache_root
    return cache_root(data_config(config)) / SUBDIR / f"{cache_key(config, ds_config)}.npy"


def _all_ranks_have(path: Path, device) -> bool:
    have = torch.tensor([1.0 if path.is_file() else 0.0], device=device)
    dist.all_reduce(have, op=dist.ReduceOp.MIN)
    return bool(have.item() == 1.0)


def attach_reference(engine, config, ds_config: dict, samplers, device) -> str | None:
    """preference.reference precomputed: give `samplers` (train, eval; None skipped) their pairs' reference
    sums, read from the cache or computed now; a line saying which (None for other modes)."""
    if config.preference.reference != "precomputed" or config.train.objective != "dpo":
        return None
    samplers = [s for s in samplers if s is not None]
    path = cache_path(config, ds_config)
    if _all_ranks_have(path, device):
        values, how = np.load(path), "read from"
    else:
        values, how = compute(engine, config, samplers, device), "computed with the starting weights into"
        if dist.get_rank() == 0:
            write_atomic_npy(path, values)
        dist.barrier()
    for sampler in samplers:
        sampler.layout.reference = values
    return (f"preference: train.objective dpo, reference: precomputed log-probs of {len(values):,} pairs, {how} "
            f"{path}")


def compute(engine, config, samplers, device) -> np.ndarray:
    """Every pair's reference (chosen, rejected) log-prob sums [groups, 2] fp32, on every rank."""
    from dstrain.data.sampler import to_device
    model = engine.module
    groups = len(samplers[0].layout.encoded.groups) - 1
    values = torch.zeros(groups, 3, dtype=torch.float64, device=device)  # chosen, rejected, times seen
    rank, world = dist.get_rank(), dist.get_world_size()
    micro = config.train.micro_batch_size
    was_training = model.training
    engine.eval()
    with torch.no_grad():
        for sampler in samplers:
            per_rank = -(-sampler.size // world)
            first, last = min(rank * per_rank, sampler.size), min((rank + 1) * per_rank, sampler.size)
            for start in range(first, first + per_rank, micro):
                real = max(0, min(micro, last - start))
                begin, count = (start, real) if real else (0, 1)  # a share run out: the same forward, not kept
                batch = to_device(sampler.batch(begin, count), device)
                sums = model.preference.sums_without_grad(model, batch)
                if real:
                    pairs = len(batch["margin"])
                    ids = torch.from_numpy(sampler.layout.groups_of(sampler.units_of(begin, count))).to(device)
                    values[ids, 0] = sums[:pairs].double()
                    values[ids, 1] = sums[pairs:].double()
                    values[ids, 2] += 1
    if was_training:
        engine.train()
    dist.all_reduce(values)
    for sampler in samplers:  # every pair of the splits once: a pair missed would read a reference of 0
        wanted = sampler.layout.groups_of([list(range(sampler.layout.count))])
        if not bool((values[torch.from_numpy(wanted).to(device), 2] == 1).all()):
            raise RuntimeError("preference.reference precomputed: the pass did not see every pair exactly once")
    return values[:, :2].float().cpu().numpy()


def write_atomic_npy(path: Path, values: np.ndarray) -> None:
    """np.save into a temporary file of the same folder, then renamed: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".npy", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as out:
            np.save(out, values)
        os.chmod(temp, 0o644)  # mkstemp's 0600 would hide the cache from other users of a shared cache_dir
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
