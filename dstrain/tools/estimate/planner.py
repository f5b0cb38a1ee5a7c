"""Which preset fits: the memory estimate of every preset for one run config and machine.

Shared by `dstrain estimate` and `dstrain run --preset auto`. The user's --config and --set are
layered on each preset in turn, so the estimate is of exactly the configs that would run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from dstrain.config.schema import LOSS_CHUNKING_MIN_VOCAB
from dstrain.config.presets import PRESET_ORDER, available
from dstrain.config.resolve import ResolvedConfig, resolve
from dstrain.errors import UserError
from dstrain.tools.estimate.memory import workload

GiB = 2**30
ASSUMED_GPU_MEM_GIB = 80  # when estimating GPUs on a machine without one


@dataclass
class Plan:
    estimates: list
    recommended: str | None
    reason: str
    hardware: object
    workload: object
    notes: list[str]
    sequence_parallel: int = 1
    """The train.sequence_parallel the recommendation needs: more than 1 only where the config left it 1, an
    "hf:" model's heads allow it, and with it a faster preset fits than without (or one fits at all)."""


def gpt_shape_for(params: float) -> tuple[int, int, int]:
    """(n_layer, d_model, n_head) of a GPT with about `params` parameters, using the common width to
    depth ratio of 128 (e.g. 4096/32 in 7B models): P ~ 12 L d^2 with d = 128 L."""
    d_model = max(128, round((params * 128 / 12) ** (1 / 3) / 128) * 128)
    n_layer = max(1, round(params / (12 * d_model * d_model)))
    return n_layer, d_model, d_model // 128


def parse_params(value: float | str | None) -> tuple[float | None, float | None, list[str]]:
    """--params as (total parameters, active parameters per token, --set lines): "7e9" (a dense GPT of that
    size), "30e9/3e9" (a mixture-of-experts shape: 30B parameters held, 3B run per token) or "hf:DIR" (the
    model DIR's config.json describes, counted on the meta device: no weights needed)."""
    if value is None:
        return None, None, []
    text = str(value).strip()
    if text.startswith("hf:"):
        return None, None, [f"model.name={text}"]
    fix = "e.g. --params 7e9, --params 30e9/3e9 (a mixture of experts: total/active) or --params hf:DIR"
    try:
        total, _, active = text.partition("/")
        total_n, active_n = float(total), float(active) if active else None
    except ValueError:
        raise UserError.single(f"not a parameter count: {text!r}", "--params", fix) from None
    if total_n < 1 or (active_n is not None and not 1 <= active_n <= total_n):
        raise UserError.single(f"must be a positive parameter count, the active part at most the total (got {text})",
                               "--params", fix)
    return total_n, active_n, []


def make_plan(config_file: Path | None, sets: list[str], params: float | str | None, gpus: int | None, nodes: int,
              gpu_mem_gib: float | None, cpu_mem_gib: float | None, accelerator: str,
              strict: bool | None = None) -> Plan:
    from dstrain.tools.estimate import memory as E

    notes: list[str] = []
    hw = E.detect_hardware()
    if gpus is not None:
        if hw.accelerator == "cpu" and accelerator == "cuda" and gpu_mem_gib is None:
            gpu_mem_gib = ASSUMED_GPU_MEM_GIB
            notes.append(f"no GPU here: assuming {ASSUMED_GPU_MEM_GIB} GiB per GPU (set --gpu-mem)")
        hw = replace(hw, gpus_per_node=gpus, accelerator=accelerator)
    hw = replace(hw, nodes=nodes)
    if gpus is not None and cpu_mem_gib is None:
        notes.append(f"host RAM: this machine's {hw.cpu_mem_bytes / GiB:.1f} GiB per node (set --cpu-mem)")
    if gpu_mem_gib is not None:
        hw = replace(hw, gpu_mem_bytes=int(gpu_mem_gib * GiB))
    if cpu_mem_gib is not None:
        hw = replace(hw, cpu_mem_bytes=int(cpu_mem_gib * GiB))
    world = hw.gpus_per_node * hw.nodes

    params, active, model_sets = parse_params(params)
    extra_sets = model_sets + list(sets)
    if params is not None:
        n_layer, d_model, n_head = gpt_shape_for(params)
        # A hypothetical model: one sequence per GPU unless --set says otherwise (--set comes later, so it wins).
        extra_sets = [f"model.n_layer={n_layer}", f"model.d_model={d_model}", f"model.n_head={n_head}",
                      "train.micro_batch_size=1"] + extra_sets
    names = [n for n in PRESET_ORDER if n in available()]

    def resolve_all(sets: list[str]) -> dict[str, ResolvedConfig]:
        return {n: resolve(n, config_file, sets, world_size=world, accelerator=hw.accelerator, strict=strict)
                for n in names}

    resolved = resolve_all(extra_sets)
    base = resolved[names[0]].config
    block_defaults = None  # an hf: model's ZeRO-3 defaults, once it is built (below)
    if params is not None:
        total = int(params)
        largest = max(base.model.vocab_size * base.model.d_model, 4 * base.model.d_model ** 2)
        notes.append(f"--params {params:.3g}: a GPT of {base.model.n_layer} layers x width {base.model.d_model}, "
                     f"micro batch {base.train.micro_batch_size} x seq_len {base.data.seq_len}")
        shape = None
        if active is not None and active < params:  # a mixture of experts: memory holds all, compute runs the active
            shape = {"inactive_params": int(params - active)}
            notes.append(f"a mixture of experts: memory for all {params:.3g} parameters, compute for the "
                         f"{active:.3g} a token runs through (the activations are estimated as a dense GPT's)")
    else:
        from dstrain.models import count_model, model_builder, model_shape
        built: list = []
        build = model_builder(base)
        total, largest = count_model(lambda: built.append(build()) or built[0])
        shape = model_shape(built[0], base)
        if base.model.name.startswith("hf:"):
            block_defaults = _hf_block_defaults(base, built[0], total, largest, shape)
            for r in resolved.values():
                block_defaults(r)
    if base.model.name == "gpt" and hw.accelerator == "cuda":  # what a run on these GPUs renders past 3B
        from dstrain.launcher.preflight import keep_large_gpt_blocks_whole
        for r in resolved.values():
            keep_large_gpt_blocks_whole(r, total, largest, lambda: hw.gpu_mem_bytes)
    if (shape or {}).get("loss_chunk_tokens") or (shape is None and base.train.loss_chunking is True):
        notes.append(f"the LM loss runs in chunks of {base.train.loss_chunk_tokens:,} tokens (train.loss_chunking): "
                     "the logits are estimated per chunk")
    estimates, work = _estimate_all(resolved, total, largest, hw, notes, shape)
    recommended, reason = E.recommend(estimates)
    plan = Plan(estimates, recommended, reason, hw, work, notes)
    fastest = names[0]
    if recommended != fastest and base.train.sequence_parallel == 1:
        # Long sequences: a faster preset (or any, where none fits) with each sequence split over the fewest
        # ranks that make it fit; the split costs two all-to-alls per layer, less than a slower preset.
        best = None
        for degree in sequence_parallel_degrees(base, world):
            trial_notes: list[str] = []
            trial_resolved = resolve_all([*extra_sets, f"train.sequence_parallel={degree}"])
            for r in trial_resolved.values() if block_defaults else ():
                block_defaults(r)
            trial, trial_work = _estimate_all(trial_resolved, total, largest, hw, trial_notes, shape)
            found, why = E.recommend(trial)
            if found is not None and (best is None or names.index(found) < names.index(best[1])):
                best = (degree, found, why, trial, trial_work, trial_notes)
            if found == fastest:
                break
        if best is not None and (recommended is None or names.index(best[1]) < names.index(recommended)):
            degree, found, why, trial, trial_work, trial_notes = best
            notes += trial_notes + [f"train.sequence_parallel={degree} splits each sequence over {degree} ranks "
                                    f"(seq_len {base.data.seq_len} -> {base.data.seq_len // degree} tokens of "
                                    f"activations per GPU), so {found} fits"
                                    + (f" instead of {recommended}" if recommended else "")]
            plan = Plan(trial, found, f"{why}, with train.sequence_parallel={degree}", hw, trial_work, notes, degree)
    if plan.recommended is not None and plan.workload is not None and (
            plan.workload.loss_chunk_tokens is not None or plan.workload.vocab_size >= LOSS_CHUNKING_MIN_VOCAB):
        notes.append(micro_batch_note(plan.recommended, plan.estimates, plan.workload, hw,
                                      base.train.loss_chunk_tokens))
    return plan


def _hf_block_defaults(base, model, total: int, largest: int, shape: dict):
    """What applies to a preset's resolved config the ZeRO-3 defaults a run gives an hf: model once it is
    built (each decoder layer one fetch, kept whole on GPUs: dstrain.launcher.preflight.apply_block_defaults);
    the decoder layers' sizes go into `shape`, so that the estimate counts the layers kept whole."""
    from dstrain.launcher.preflight import apply_block_defaults
    from dstrain.models import ModelFacts, decoder_layer_facts, setup, trainable_parameters
    setup.apply_freezing(base, model)  # on the meta model: only to count what trains
    block, block_largest, block_total = decoder_layer_facts(model)
    facts = ModelFacts(total, trainable_parameters(model), largest, block, block_largest=block_largest,
                       block_params=block_total)
    shape.update(layer_params=block_total, layer_largest=block_largest)
    return lambda resolved: apply_block_defaults(resolved, facts)


def _estimate_all(resolved: dict[str, ResolvedConfig], total: int, largest: int, hw, notes: list[str],
                  shape: dict | None = None):
    """Every preset's estimate (each may switch activation checkpointing on or off), and the last workload."""
    from dstrain.tools.estimate import memory as E

    estimates, work = [], None
    for name, r in resolved.items():
        checkpointing, why = checkpointing_decision(r.config, r.ds_config, total, largest, hw, shape)
        if why:
            notes.append(f"{name}: activation checkpointing {why} (train.activation_checkpointing=auto)")
        work = workload(r.config, r.ds_config, total, largest, checkpointing, shape)
        estimates.append(E.estimate_one(name, E.placement_from_ds_config(r.ds_config), work, hw))
    return estimates, work


def sequence_parallel_degrees(cfg, world: int) -> list[int]:
    """The train.sequence_parallel values above 1 this run could take, fewest ranks first: an "hf:" model,
    a divisor of the world size and of seq_len that splits the model's heads."""
    if not cfg.model.name.startswith("hf:"):
        return []
    from dstrain.models.hf import load_config, sequence_parallel_problem
    hf_config = load_config(cfg)
    return [d for d in range(2, world + 1) if world % d == 0 and cfg.data.seq_len % d == 0
            and sequence_parallel_problem(hf_config, d) is None]


def micro_batch_note(name: str, estimates: list, work, hw, chunk_tokens: int) -> str:
    """How large a micro batch the chunked LM loss lets the preset fit, against the whole logits (a large
    vocabulary's run says so whether or not it chunks: auto leaves chunking off where the run fits)."""
    from dstrain.tools.estimate import memory as E

    placement = next(e.placement for e in estimates if e.name == name)
    chunked = E.largest_micro_batch(placement, replace(work, loss_chunk_tokens=work.loss_chunk_tokens or chunk_tokens), hw)
    whole = E.largest_micro_batch(placement, replace(work, loss_chunk_tokens=None), hw)
    on = "on" if work.loss_chunk_tokens is not None else "off"
    return (f"{name}: micro batch up to {chunked} fits with the LM loss in chunks, {whole} with the whole logits "
            f"(train.loss_chunking, {on} in this run; its micro batch: {work.micro_batch})")


def checkpointing_decision(cfg, ds_config: dict, total: int, largest: int, hw,
                           shape: dict | None = None) -> tuple[bool, str | None]:
    """Whether the run checkpoints activations: train.activation_checkpointing, or for "auto" the
    estimate's answer on `hw` (memory.auto_checkpointing), with why (None where the user chose)."""
    from dstrain.tools.estimate import memory as E

    chosen = cfg.train.activation_checkpointing
    if chosen != "auto":
        return bool(chosen), None
    if cfg.model.name != "gpt":  # the activation formulas are the built-in GPT's
        return True, "on: dstrain estimates the activations of its built-in GPT only"
    work = workload(cfg, ds_config, total, largest, True, shape)
    return E.auto_checkpointing(E.placement_from_ds_config(ds_config), work, hw)


def choose_preset(config_file: Path | None, sets: list[str], ranks: int, nodes: int,
                  accelerator: str) -> tuple[str, str, int]:
    """`--preset auto`: the fastest preset whose estimate fits this machine, why, and the
    train.sequence_parallel it needs (1: the config's own; see make_plan)."""
    plan = make_plan(config_file, sets, None, ranks, nodes, None, None, accelerator)
    if plan.recommended is None:
        raise UserError.single(plan.reason, "--preset auto", "see `dstrain estimate` for the figures")
    micro = [n for n in plan.notes if n.startswith(f"{plan.recommended}: micro batch up to")]
    return plan.recommended, plan.reason + "".join(f"; {n.split(': ', 1)[1]}" for n in micro), plan.sequence_parallel
