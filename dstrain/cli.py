"""The `dstrain` command line: thin Typer commands that hand off to one module each.

Nothing heavy is imported at module level: `dstrain --help`, `presets` and `config` never import
torch or DeepSpeed, so they answer at once. Bad input raises UserError, printed here with exit code 2.
"""

from __future__ import annotations

import functools
import sys
import warnings
from pathlib import Path
from typing import Callable, List, Optional

import typer

from dstrain.errors import EXIT_BAD_INPUT, UserError

# transformers 5 warns of its own deprecated property whenever peft reads it (pre-flight, generate): nothing
# a user can act on. The ranks route it to their logs instead (dstrain/rank/output.py).
warnings.filterwarnings("ignore", message=r".*`is_gradient_checkpointing` is deprecated", category=FutureWarning)

app = typer.Typer(
    name="dstrain",
    help="Config-driven DeepSpeed training: pick a preset, see the exact config, launch the real ranks.\n\n"
    "Examples:\n\n  dstrain presets\n\n  dstrain config --preset stage2_offload --deepspeed-json\n\n"
    "  dstrain run --preset stage2_offload\n\n  dstrain estimate --params 7e9 --gpus 8",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

PresetOpt = typer.Option(None, "--preset", "-p", help="Preset name (see `dstrain presets`); '-' or '_' both work.")
ConfigOpt = typer.Option(None, "--config", "-c", help="YAML or JSON run config; may name its preset with 'preset:'.")
SetOpt = typer.Option(None, "--set", "-s", help="Override any key: --set train.lr=3e-4 (repeatable).")
GpusOpt = typer.Option(None, "--gpus", help="Ranks per node (GPUs; CPU ranks with --accelerator cpu). Default: all GPUs, or 2 CPU ranks.")
NodesOpt = typer.Option(1, "--nodes", help="Number of nodes.")
StrictOpt = typer.Option(False, "--strict", help="DeepSpeed keys that DeepSpeed would ignore are errors, "
                         "not warnings (also DSTRAIN_STRICT=1).")
AccelOpt = typer.Option("auto", "--accelerator", help="auto (CUDA when present), cuda or cpu (gloo ranks, for development and CI).")


def _stderr():
    from rich.console import Console
    return Console(stderr=True, highlight=False)


def handles_user_errors(func: Callable) -> Callable:
    """Print UserError as a message (no traceback) and exit with code 2."""
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except UserError as err:
            from dstrain.console_text import outside  # the message quotes user text: '[/x]' is no markup
            _stderr().print(f"[bold red]error:[/] {outside(err)}", markup=True, soft_wrap=True)
            raise typer.Exit(EXIT_BAD_INPUT)
    return wrapper


def _world(gpus: Optional[int], nodes: int, accelerator: str) -> tuple[int, str]:
    from dstrain.hardware import default_ranks_per_node, resolve_accelerator
    if nodes < 1 or (gpus is not None and gpus < 1):
        raise UserError.single("must be at least 1", "--gpus/--nodes", "e.g. --gpus 2 --nodes 1")
    if accelerator not in ("auto", "cuda", "cpu"):
        raise UserError.single(f"unknown accelerator {accelerator!r}", "--accelerator", "use auto, cuda or cpu")
    acc = resolve_accelerator(accelerator)
    ranks = gpus if gpus is not None else default_ranks_per_node(acc)
    return ranks * nodes, acc


@app.command("presets")
@handles_user_errors
def presets_cmd(name: Optional[str] = typer.Argument(None, help="Show this preset's file.")) -> None:
    """List the shipped presets, or show one.

    Examples:

      dstrain presets

      dstrain presets stage3-offload
    """
    from dstrain.config import show
    show.presets(name)


@app.command("config")
@handles_user_errors
def config_cmd(
    preset: Optional[str] = PresetOpt,
    config: Optional[Path] = ConfigOpt,
    set_: Optional[List[str]] = SetOpt,
    gpus: Optional[int] = GpusOpt,
    nodes: int = NodesOpt,
    accelerator: str = AccelOpt,
    explain: bool = typer.Option(False, "--explain", help="Show which layer set each key."),
    deepspeed_json: bool = typer.Option(False, "--deepspeed-json", help="Print exactly the JSON given to deepspeed.initialize."),
    strict: bool = StrictOpt,
) -> None:
    """Resolve and print the run config (defaults < preset < --config < PL_DEEPSPEED_CONFIG_PATH < --set).

    Examples:

      dstrain config --preset stage2_offload --deepspeed-json

      dstrain config --config run.yaml --set train.micro_batch_size=4 --gpus 8 --explain

      PL_DEEPSPEED_CONFIG_PATH=ds.json dstrain config --deepspeed-json --strict
    """
    from dstrain.config import show
    from dstrain.config.resolve import resolve
    world, acc = _world(gpus, nodes, accelerator)
    resolved = resolve(preset, config, set_ or [], world_size=world, accelerator=acc, strict=strict or None)
    show.resolved_config(resolved, explain=explain, deepspeed_json=deepspeed_json)


@app.command("run")
@handles_user_errors
def run_cmd(
    preset: Optional[str] = PresetOpt,
    config: Optional[Path] = ConfigOpt,
    set_: Optional[List[str]] = SetOpt,
    gpus: Optional[int] = GpusOpt,
    nodes: Optional[int] = typer.Option(None, "--nodes", help="Number of nodes. Default: every host of --hostfile, else 1."),
    hostfile: Optional[Path] = typer.Option(None, "--hostfile", help="DeepSpeed hostfile: 'host slots=N' per line."),
    include: Optional[str] = typer.Option(None, "--include", help="Hosts/GPUs to use, e.g. 'node1:0,1@node2'."),
    exclude: Optional[str] = typer.Option(None, "--exclude", help="Hosts/GPUs to skip, e.g. 'node1:3'."),
    master_port: Optional[int] = typer.Option(None, "--master-port", help="Rendezvous port (default: a free one)."),
    master_addr: Optional[str] = typer.Option(None, "--master-addr", help="Rendezvous address of node rank 0."),
    launcher: Optional[str] = typer.Option(None, "--launcher", help="Multi-node backend: pdsh, openmpi, mvapich, slurm, mpich, impi."),
    node_rank: Optional[int] = typer.Option(None, "--node-rank", help="This node's rank, with --no-ssh."),
    no_ssh: bool = typer.Option(False, "--no-ssh", help="Start this node's ranks only; run once per node (with --node-rank)."),
    accelerator: str = AccelOpt,
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="Where config, metrics and checkpoints go (default runs/<time>-<preset>)."),
    resume: Optional[str] = typer.Option(None, "--resume", help="'latest', a checkpoint path/tag to continue from, or 'auto' (latest when --run-dir has a complete checkpoint, else start fresh: one command for a requeue loop)."),
    join_timeout: Optional[float] = typer.Option(None, "--join-timeout", min=0, help="Several nodes: seconds to wait for every node's ranks to start before ending the job, naming the nodes that never came (train.join_timeout_s: 300 unless the config says otherwise; 0: wait as long as it takes)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Validate everything and print the plan; start nothing."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show DeepSpeed's own INFO logging."),
    strict: bool = StrictOpt,
) -> None:
    """Train: write the run directory, then start the ranks through the deepspeed launcher.

    Examples:

      dstrain run --preset stage2_offload

      dstrain run --preset stage3 --gpus 8 --set train.max_steps=1000 --run-dir runs/big

      dstrain run --preset stage2 --accelerator cpu --gpus 2 --run-dir D --resume latest

      dstrain run --config run.yaml --hostfile hosts --launcher pdsh --dry-run
    """
    from dstrain.launcher.job import launch
    from dstrain.launcher.options import LaunchOptions
    world_per_node_gpus = gpus
    options = LaunchOptions(
        preset=preset, config_file=config, sets=set_ or [], gpus=world_per_node_gpus, nodes=nodes,
        hostfile=hostfile, include=include, exclude=exclude, master_port=master_port,
        master_addr=master_addr, launcher=launcher, node_rank=node_rank, no_ssh=no_ssh,
        accelerator=accelerator, run_dir=run_dir, resume=resume, join_timeout_s=join_timeout, dry_run=dry_run,
        verbose=verbose, strict=strict or None)
    code = launch(options)
    raise typer.Exit(code)


@app.command("estimate")
@handles_user_errors
def estimate_cmd(
    preset: Optional[str] = typer.Option(None, "--preset", "-p", help="Highlight this preset (all six are estimated)."),
    config: Optional[Path] = ConfigOpt,
    set_: Optional[List[str]] = SetOpt,
    params: Optional[str] = typer.Option(None, "--params", help="Instead of the config's model: a parameter count "
                                         "(7e9), a mixture of experts' total/active (30e9/3e9), or hf:DIR (its config.json)."),
    gpus: Optional[int] = typer.Option(None, "--gpus", help="GPUs per node (default: this machine's)."),
    nodes: int = NodesOpt,
    gpu_mem: Optional[float] = typer.Option(None, "--gpu-mem", help="GiB per GPU (default: this machine's)."),
    cpu_mem: Optional[float] = typer.Option(None, "--cpu-mem", help="GiB of host RAM per node (default: this machine's)."),
    accelerator: str = typer.Option("cuda", "--accelerator", help="cuda (estimate GPUs) or cpu (CPU ranks)."),
    json_output: bool = typer.Option(False, "--json", help="Print JSON instead of the table."),
    strict: bool = StrictOpt,
) -> None:
    """Estimate GPU, host and NVMe memory of every preset, and recommend the fastest that fits.

    Examples:

      dstrain estimate --params 7e9 --gpus 8 --gpu-mem 80

      dstrain estimate --config run.yaml --set train.activation_checkpointing=true

      dstrain estimate --params 13e9 --gpus 8 --nodes 2 --json

      dstrain estimate --params 30e9/3e9 --gpus 8

      dstrain estimate --params hf:Qwen/Qwen3-30B-A3B --gpus 8
    """
    import json as jsonlib
    from rich.console import Console
    from dstrain.tools.estimate import memory as E
    from dstrain.tools.estimate.planner import make_plan
    if accelerator not in ("cuda", "cpu"):
        raise UserError.single(f"unknown accelerator {accelerator!r}", "--accelerator", "use cuda or cpu")
    if preset:
        from dstrain.config.presets import preset_path
        preset_path(preset)
    plan = make_plan(config, set_ or [], params, gpus, nodes, gpu_mem, cpu_mem, accelerator, strict=strict or None)
    if json_output:
        report = E.to_json(plan.estimates, plan.recommended, plan.reason, plan.hardware, plan.workload)
        report["notes"] = plan.notes
        sys.stdout.write(jsonlib.dumps(report, indent=2) + "\n")
        return
    from dstrain.console_text import outside
    console = Console(highlight=False)
    for note in plan.notes:
        console.print(f"[dim]{outside(note)}[/]")
    E.render(plan.estimates, plan.recommended, plan.reason, plan.hardware, plan.workload, console)


@app.command("convert-checkpoint")
@handles_user_errors
def convert_cmd(
    checkpoint_dir: Path = typer.Argument(..., help="A DeepSpeed save directory (with 'latest') or one tag inside it."),
    output: Path = typer.Argument(..., help="Output file: .safetensors (default format) or .pt; a directory with --to-universal."),
    tag: Optional[str] = typer.Option(None, "--tag", help="Checkpoint tag (default: the one 'latest' names)."),
    dtype: str = typer.Option("fp32", "--dtype", help="fp32, bf16 or fp16."),
    max_shard_size: Optional[str] = typer.Option(None, "--max-shard-size", help="e.g. 5GB: shards + index JSON (Hugging Face layout)."),
    force: bool = typer.Option(False, "--force", help="Overwrite OUTPUT if it exists."),
    to_universal: bool = typer.Option(False, "--to-universal", help="Write a DeepSpeed universal checkpoint (resume with another world size)."),
    output_format: str = typer.Option("file", "--format", help="file (one weights file, by OUTPUT's suffix), hf (a folder from_pretrained loads; hf: models) or peft (the LoRA adapters alone, a folder PeftModel.from_pretrained loads on the base model)."),
    hf_source: Optional[Path] = typer.Option(None, "--hf-source", help="With --format hf or peft: the folder with config.json and tokenizer (default: the run's hf_source/)."),
) -> None:
    """Consolidate sharded ZeRO checkpoints (any stage, any rank count) into one weights file.

    Examples:

      dstrain convert-checkpoint runs/x/checkpoints model.safetensors

      dstrain convert-checkpoint runs/x/checkpoints model.pt --tag step00000100 --dtype bf16

      dstrain convert-checkpoint runs/x/checkpoints out/ --max-shard-size 5GB --force

      dstrain convert-checkpoint runs/x/checkpoints runs/x/universal --to-universal

      dstrain convert-checkpoint runs/x/checkpoints out/llama-ft --format hf --dtype bf16

      dstrain convert-checkpoint runs/x/checkpoints out/llama-adapter --format peft
    """
    from rich.console import Console
    from dstrain.console_text import outside  # the summaries name the user's paths and tags
    from dstrain.tools import convert
    console = Console(highlight=False)
    if output_format not in ("file", "hf", "peft"):
        raise UserError.single(f"unknown format {output_format!r}", "--format", "use file, hf or peft")
    if output_format == "peft":
        from dstrain.tools.convert.peft_folder import export_peft_folder
        export = export_peft_folder(checkpoint_dir, output, tag=tag, dtype=dtype, force=force, source=hf_source)
        console.print(outside(export.summary()), soft_wrap=True)
        return
    if output_format == "hf":
        from dstrain.tools.convert.hf_folder import export_hf_folder
        export = export_hf_folder(checkpoint_dir, output, tag=tag, dtype=dtype, max_shard_size=max_shard_size,
                                  force=force, source=hf_source)
        console.print(outside(export.summary()), soft_wrap=True)
        return
    if to_universal:
        path = convert.to_universal(checkpoint_dir, output, tag=tag, force=force)
        console.print(f"universal checkpoint written to {outside(path)}")
        return
    report = convert.convert_checkpoint(checkpoint_dir, output, tag=tag, dtype=dtype,
                                        max_shard_size=max_shard_size, force=force)
    console.print(outside(report.summary()), soft_wrap=True)


@app.command("generate")
@handles_user_errors
def generate_cmd(
    target: Path = typer.Argument(..., help="A model folder (final_hf, --format hf), a peft adapter folder (final_adapter, --format peft) or a run directory (its newest export, or its latest checkpoint converted)."),
    prompt: Optional[str] = typer.Option(None, "--prompt", help="Text to complete (with --chat: the one user turn)."),
    chat: bool = typer.Option(False, "--chat", help="Apply the tokenizer's chat template; without --prompt, user turns are read from stdin."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", help="Tokens to generate at most."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 (default): greedy; above 0: sampling."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling's probability mass (with --temperature)."),
) -> None:
    """Print what a trained model writes: transformers' generate on an exported folder or a run.

    Examples:

      dstrain generate runs/ft --prompt "The capital of France is"

      dstrain generate runs/ft/final_adapter --chat --prompt "Name three colours."

      dstrain generate out/llama-ft --chat --temperature 0.7 --top-p 0.9
    """
    from dstrain.tools.generate import generate
    raise typer.Exit(generate(target, prompt, chat, max_new_tokens, temperature, top_p))


@app.command("doctor")
def doctor_cmd(
    json_output: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    nvme_path: Optional[Path] = typer.Option(None, "--nvme-path", help="Check this NVMe offload directory (write/read speed)."),
) -> None:
    """Check this machine: versions, GPUs, RAM, DeepSpeed ops, libaio, NVMe path, each problem with its fix.

    Examples:

      dstrain doctor

      dstrain doctor --json --nvme-path /local_nvme
    """
    from dstrain.tools import doctor
    raise typer.Exit(doctor.main(json_output, nvme_path))


@app.command("eval")
@handles_user_errors
def eval_cmd(
    run_dir: Path = typer.Option(..., "--run-dir", help="The run directory of a `dstrain run`."),
    resume: str = typer.Option("latest", "--resume", help="Checkpoint to evaluate: latest, a tag, or a path."),
    accelerator: str = AccelOpt,
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show DeepSpeed's own INFO logging."),
) -> None:
    """Evaluate a checkpoint on the held-out split with the run's own preset and world size.

    Examples:

      dstrain eval --run-dir runs/x

      dstrain eval --run-dir runs/x --resume step00000100
    """
    from dstrain.launcher.eval_job import evaluate_run
    raise typer.Exit(evaluate_run(run_dir, resume, accelerator, verbose))


def _sub_app(name: str, help_text: str) -> typer.Typer:
    """A command group (`dstrain NAME COMMAND`), set up as the top-level app is."""
    group = typer.Typer(help=help_text, no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                        rich_markup_mode=None)
    app.add_typer(group, name=name)
    return group


checkpoint_app = _sub_app("checkpoint", "Inspect checkpoints: `dstrain checkpoint verify DIR`.")


@checkpoint_app.command("verify")
@handles_user_errors
def checkpoint_verify_cmd(
    target: Path = typer.Argument(..., help="A run directory, its checkpoints/ directory or one tag directory."),
    hashes: bool = typer.Option(True, "--hashes/--no-hashes", help="Compare SHA-256 (reads every file) or sizes only."),
) -> None:
    """Check checkpoints against their completion marks (every file present, same size, same SHA-256) and
    say which are safe to resume from or convert. Exit 0 when intact, 2 when damaged or incomplete.

    Examples:

      dstrain checkpoint verify runs/x

      dstrain checkpoint verify runs/x/checkpoints/step00000100
    """
    from dstrain.tools.checkpoint_verify import verify_checkpoints
    raise typer.Exit(verify_checkpoints(target, hashes))


data_app = _sub_app("data", "Look at the training data: `dstrain data preview --config run.yaml`.")


@data_app.command("preview")
@handles_user_errors
def data_preview_cmd(
    preset: Optional[str] = PresetOpt,
    config: Optional[Path] = ConfigOpt,
    set_: Optional[List[str]] = SetOpt,
    examples: int = typer.Option(3, "--examples", "-n", min=0, help="Training examples to show, trained tokens marked."),
    strict: bool = StrictOpt,
) -> None:
    """Tokenize the run's rows as `dstrain run` would (and cache them) and show the counts (kept, cut to
    seq_len, left out and why, held out), the lengths, the packing efficiency, and the first examples
    with the tokens the loss is taken on marked. Starts no ranks.

    Examples:

      dstrain data preview --config examples/data/config.yaml

      dstrain data preview --config run.yaml --set data.format=alpaca --set data.chat_template=chatml -n 5
    """
    from dstrain.config.resolve import resolve
    from dstrain.tools.data_preview import preview
    resolved = resolve(preset, config, set_ or [], world_size=1, accelerator="cpu", strict=strict or None)
    preview(resolved.config, examples, resolved.warnings)


@app.command("report")
@handles_user_errors
def report_cmd(
    run_dirs: List[Path] = typer.Argument(..., help="Run directories of `dstrain run` (several: overlaid)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="HTML page to write; the PNGs go beside it "
                                          "(default: RUN_DIR/report.html for one run, ./report.html for several)."),
) -> None:
    """Plot runs from their metrics.jsonl: loss and eval loss, lr, gradient norm, tokens/s, memory, rollbacks
    marked; PNG images and one self-contained HTML page, and a summary table here. Needs matplotlib.

    Examples:

      dstrain report runs/x

      dstrain report runs/a runs/b -o compare.html
    """
    from rich.console import Console
    from dstrain.tools.report import report
    report(run_dirs, output, Console(highlight=False))


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
