"""Printing presets and resolved configs for people (rich) and for programs (plain JSON/YAML)."""

from __future__ import annotations

import json
import sys

import yaml
from rich.console import Console
from rich.table import Table
from rich.text import Text

from dstrain.config import presets as preset_files
from dstrain.config.layers import flatten
from dstrain.config.resolve import ResolvedConfig, redact
from dstrain.console_text import outside


def presets(name: str | None) -> None:
    console = Console(highlight=False)
    if name:
        path = preset_files.preset_path(name)
        console.print(f"[dim]{outside(path)}[/]")
        sys.stdout.write(path.read_text())
        return
    table = Table(title="dstrain presets (fastest first; each step down saves memory)", title_justify="left")
    table.add_column("preset", style="bold")
    table.add_column("what it trades")
    for preset in preset_files.available():
        table.add_row(Text(preset), Text(preset_files.description(preset)))
    console.print(table)
    console.print("Show one: dstrain presets NAME    Run one: dstrain run --preset NAME")


def resolved_config(resolved: ResolvedConfig, *, explain: bool, deepspeed_json: bool) -> None:
    err = Console(stderr=True, highlight=False)
    for warning in resolved.warnings:
        err.print(f"[yellow]warning:[/] {outside(warning)}", soft_wrap=True)
    if deepspeed_json:
        sys.stdout.write(json.dumps(redact(resolved.ds_config), indent=2) + "\n")
        return
    data = redact(resolved.config.model_dump(mode="json"))
    if not explain:
        sys.stdout.write(yaml.safe_dump(data, sort_keys=False))
        return
    table = Table(title=f"resolved config (world size {resolved.world_size}, {resolved.accelerator})",
                  title_justify="left")
    table.add_column("key", overflow="fold")
    table.add_column("value", overflow="fold")
    table.add_column("set by", style="dim")
    for path, value in flatten(data).items():
        # Text, not str: values and paths are user text, and '[bold]' in them is not markup.
        table.add_row(Text(path), Text(json.dumps(value)), Text(resolved.sources.get(path, "default")))
    Console(highlight=False).print(table)


def plan_lines(config, ds_config: dict, world: int, accelerator: str, preset: str | None,
               param_count: int | None = None, trainable: int | None = None) -> list[str]:
    """The run plan: batch arithmetic, tokens per step, where states live (printed by run and rank 0)."""
    t = config.train
    zero = ds_config.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    opt_dev = (zero.get("offload_optimizer") or {}).get("device", "none")
    par_dev = (zero.get("offload_param") or {}).get("device", "none")
    device = "GPU" if accelerator == "cuda" else "CPU rank memory"
    where_params = par_dev.upper() if par_dev in ("cpu", "nvme") and stage == 3 else device  # DeepSpeed: stage 3 only
    where_opt = opt_dev.upper() if opt_dev in ("cpu", "nvme") else device

    def sharded(on: bool) -> str:
        return "sharded" if on else "replicated"

    tokens = t.global_batch_size * config.data.seq_len
    sp = t.sequence_parallel
    ranks = f"world {world}" if sp == 1 else f"{world // sp} data-parallel groups (world {world} / sequence_parallel {sp})"
    split = "" if sp == 1 else f"; each sequence split over {sp} ranks, {config.data.seq_len // sp} tokens each"
    lines = [
        f"preset {preset or '(none)'}, ZeRO stage {stage}, precision {t.precision}, "
        f"accelerator {accelerator}, world size {world}",
        f"batch: micro {t.micro_batch_size} x grad accum {t.grad_accum_steps} x {ranks} "
        f"= {t.global_batch_size} sequences x {config.data.seq_len} tokens = {tokens:,} tokens/step{split}",
        f"params: {where_params}, {sharded(stage >= 3)}; gradients: {sharded(stage >= 2)}; "
        f"optimizer states: {where_opt}, {sharded(stage >= 1)}",
    ]
    if param_count is not None:
        trains = "" if trainable is None else f", {trainable:,} trainable ({100 * trainable / max(param_count, 1):.2f}%)"
        chunked = f"; LM loss in chunks of {t.loss_chunk_tokens:,} tokens" if t.loss_chunking is True else ""
        tiled = "; MLPs tiled along the sequence (train.tiled_mlp)" if t.tiled_mlp is True else ""
        lines.append(f"model: {config.model.name}, {param_count:,} parameters{trains}{chunked}{tiled}")
    return lines
