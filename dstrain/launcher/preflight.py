"""Checks before anything is written or spawned, for the ones that need torch or DeepSpeed: DeepSpeed's
own config models, the model (built on the meta device: no memory), the data source, the NVMe
swap buffer, and op-build locks left by killed builds.

The pure config checks are in dstrain/config/; these run after them, still in the `dstrain` process,
so a typo costs seconds, not a GPU allocation.
"""

from __future__ import annotations

import shlex

from rich.console import Console

from dstrain.config.resolve import ResolvedConfig
from dstrain.errors import UserError


def _fit_nvme_swap_buffer(resolved: ResolvedConfig, largest: int) -> None:
    """NVMe parameter offload swaps through buffers of offload_param.buffer_size elements, and DeepSpeed
    fails mid-start when one parameter (a large embedding, say) does not fit one: grow it to fit."""
    offload = (resolved.ds_config.get("zero_optimization") or {}).get("offload_param") or {}
    if offload.get("device") == "nvme" and int(offload.get("buffer_size", 100_000_000)) < largest:
        offload["buffer_size"] = largest
        resolved.warnings.append(f"deepspeed.zero_optimization.offload_param.buffer_size raised to {largest:,}: "
                                 "the model's largest parameter must fit one NVMe swap buffer")


def check_runtime(resolved: ResolvedConfig) -> int:
    """Checks that import DeepSpeed/torch: DeepSpeed's config models, the model (built on the meta
    device: no memory) and the data source. Returns the parameter count."""
    from dstrain.config import deepspeed_models
    problems = deepspeed_models.validate(resolved.ds_config)
    if problems:
        raise UserError(problems)
    from dstrain.models import check_model
    try:
        facts = check_model(resolved.config)
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001 - a user model that cannot be built is bad input
        raise UserError.single(f"building the model failed: {type(err).__name__}: {err}", "model",
                               "check model.name and model.kwargs")
    _check_data(resolved)
    check_trackers(resolved)
    _fit_nvme_swap_buffer(resolved, facts.largest)
    _fetch_blocks_whole(resolved, facts.block_class)
    return facts.params


def _fetch_blocks_whole(resolved: ResolvedConfig, block_class: str | None) -> None:
    """ZeRO-3 with an hf: model: each transformer block is one fetch (DeepSpeed's leaf modules), as
    dstrain/config/resolve.py does for the built-in GPT, unless the user chose the granularity.
    DeepSpeed's own default leaf classes (MoE blocks) are kept."""
    zero = resolved.ds_config.get("zero_optimization")
    if (block_class is None or not isinstance(zero, dict) or zero.get("stage") != 3
            or "leaf_module" in zero or "stage3_module_granularity_threshold" in zero
            or (zero.get("offload_param") or {}).get("device") == "nvme"):
        return
    from deepspeed.runtime.zero.leaf_module_config import DEFAULT_LEAF_MODULE_CLASSES
    zero["leaf_module"] = {"classes": [*DEFAULT_LEAF_MODULE_CLASSES, block_class]}
    resolved.sources["deepspeed.zero_optimization.leaf_module"] = \
        f"dstrain default for hf: models at stage 3: a {block_class.rsplit('.', 1)[-1]} is one ZeRO-3 fetch"


# train.log_to name -> (the module it needs, the pip extra that installs it); csv needs nothing.
TRACKER_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}


def check_trackers(resolved: ResolvedConfig) -> None:
    """Every tracker train.log_to names has its package installed (here: the ranks share this Python), and
    a user's "module:Class" imports and has the tracker methods."""
    import importlib.util

    from dstrain.entrypoints import is_entry_point, load_tracker_class
    from dstrain.errors import Problem
    where = "train.log_to" + (f" (from {resolved.sources['train.log_to']})" if "train.log_to" in resolved.sources else "")
    problems = []
    for name in resolved.config.train.log_to:
        if is_entry_point(name):  # a user's class: imported and checked here, before any rank starts
            try:
                load_tracker_class(name, where)
            except UserError as err:
                problems += err.problems
            continue
        module, extra = TRACKER_PACKAGES.get(name, (None, None))
        if module and importlib.util.find_spec(module) is None:
            problems.append(Problem(f"{name} is not installed", where,
                                    f"pip install 'dstrain[{extra}]' (or {module}), or remove {name} from train.log_to"))
    if problems:
        raise UserError(problems)


def _check_data(resolved: ResolvedConfig) -> None:
    from dstrain.data import check_source
    resolved.warnings += check_source(resolved.config)


def clear_stale_build_locks(console: Console, dry_run: bool) -> None:
    """An op build killed mid-way leaves torch's lock file behind, and every later build of that op
    then waits for it forever, silently, inside the ranks. Such locks go before the ranks start."""
    from dstrain.launcher.env_fixes import stale_extension_locks
    for lock in stale_extension_locks():
        if dry_run:
            console.print(f"[yellow]note:[/] stale op build lock {lock} (left by a killed build); a run removes it")
            continue
        try:
            lock.unlink(missing_ok=True)
        except OSError as err:
            raise UserError.single(f"stale op build lock {lock} cannot be removed ({err}): the ranks would wait "
                                   "on it forever", "TORCH_EXTENSIONS_DIR", f"rm {shlex.quote(str(lock))}")
        console.print(f"[yellow]note:[/] removed stale op build lock {lock} (left by a killed build)")
