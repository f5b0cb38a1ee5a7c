"""`dstrain report RUN_DIR [RUN_DIR ...] [-o report.html]`: a run's curves as PNG images and one
self-contained HTML page (the images embedded), several runs overlaid, and a summary table on the console.

Reads only metrics.jsonl and the checkpoints' completion marks (through dstrain/run_summary.py);
imports neither torch nor DeepSpeed. matplotlib is the optional `report` extra.

A run that was rolled back or resumed logs some steps twice: each stretch of increasing steps is drawn
as its own line, the abandoned ones faded, and every rollback event is marked with a vertical line.
"""

from __future__ import annotations

import base64
import html
import math
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from dstrain import run_summary as rs
from dstrain.console_text import outside
from dstrain.errors import Problem, UserError, require_package

# (file stem, title, y label, [(metrics.jsonl key, legend suffix)], log-scale y)
PANELS = (
    ("loss", "Loss", "loss", [("loss", "train"), ("eval_loss", "eval")], False),
    ("lr", "Learning rate", "lr", [("lr", "")], False),
    ("rewards", "Preference rewards (beta x log-ratio)", "reward", [("rewards/chosen", "chosen"),
                                                                  ("rewards/rejected", "rejected"),
                                                                  ("rewards/margins", "margin")], False),
    ("accuracy", "Preference accuracy (chosen reward > rejected)", "fraction of pairs",
     [("rewards/accuracies", "train"), ("eval_rewards/accuracies", "eval"), ("accuracy", "train"),
      ("eval_accuracy", "eval")], False),
    ("grad_norm", "Gradient norm (before clipping)", "global L2 norm", [("grad_norm", "")], True),
    ("moe_loss", "Mixture of experts: LM and balancing loss", "loss", [("lm_loss", "LM"), ("aux_loss", "balancing")],
     False),
    ("expert_load", "Experts' load (busiest expert's tokens over the mean, worst layer)", "max / mean",
     [("expert_load", "")], False),
    ("throughput", "Throughput", "tokens/s", [("tokens_per_s", "all positions"), ("real_tokens_per_s", "real (non-pad)")],
     False),
    ("memory", "Memory", "GiB", [("gpu_mem_allocated_gib", "GPU allocated"), ("gpu_mem_reserved_gib", "GPU reserved"),
                                 ("host_rss_gib", "host RSS")], False),
)


@dataclass
class RunData:
    run_dir: Path
    name: str
    records: list[dict]
    summary: rs.RunSummary


def load_runs(run_dirs: list[Path]) -> list[RunData]:
    """Every run directory read; all bad ones reported together (exit 2)."""
    runs, problems = [], []
    for run_dir in run_dirs:
        try:
            records = rs.load_records(run_dir)
        except UserError as err:
            problems += err.problems
            continue
        if not rs.train_rows(records) and not rs.eval_rows(records):
            problems.append(Problem("metrics.jsonl holds no logged step yet", str(run_dir / "metrics.jsonl"),
                                    "wait for the first log step (train.log_every), or give another run"))
            continue
        runs.append(RunData(run_dir, _name(run_dir, run_dirs), records, rs.summarize(run_dir, records)))
    if problems:
        raise UserError(problems)
    return runs


def _name(run_dir: Path, all_dirs: list[Path]) -> str:
    """The directory's name, or its last two parts where two runs share a name."""
    name = run_dir.resolve().name
    same = [d for d in all_dirs if d.resolve().name == name]
    return name if len(same) == 1 else "/".join(run_dir.resolve().parts[-2:])


Curve = tuple[list[int], list[float]]


def split_curve(rows: list[dict], key: str) -> tuple[Curve, list[Curve], list[int]]:
    """`key` over the steps: (the line the run went on with, the stretches it abandoned, the steps where
    the value was not finite). A row is abandoned when a later row logs the same or an earlier step
    (a rollback, or a resume from an earlier checkpoint); each abandoned stretch starts at the row
    logged before it, so it branches off the line."""
    points = [(r["step"], float(r[key])) for r in rows
              if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
    superseded, lowest_later = [False] * len(points), math.inf
    for i in range(len(points) - 1, -1, -1):
        superseded[i] = lowest_later <= points[i][0]
        lowest_later = min(lowest_later, points[i][0])
    kept: Curve = ([], [])
    abandoned: list[Curve] = []
    for i, (step, value) in enumerate(points):
        if not superseded[i]:
            kept[0].append(step)
            kept[1].append(value)
            continue
        if i == 0 or not superseded[i - 1] or points[i - 1][0] >= step:
            abandoned.append(([points[i - 1][0]], [points[i - 1][1]]) if i and points[i - 1][0] < step else ([], []))
        abandoned[-1][0].append(step)
        abandoned[-1][1].append(value)
    return kept, abandoned, [step for step, value in points if not math.isfinite(value)]


def _plot_panel(plt, runs: list[RunData], title: str, ylabel: str, series, log_y: bool, path: Path) -> bool:
    """One PNG; False (nothing written) when no run has any of the panel's metrics. Non-finite values
    (NaN, inf) cannot be drawn as points: they are marked with a red x at the top edge."""
    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=110)
    drawn, marked_bad = False, False
    styles = ["-", "--", ":"]
    for index, run in enumerate(runs):
        color = f"C{index % 10}"
        metric_rows = [r for r in run.records if "event" not in r]
        for (key, suffix), style in zip(series, styles):
            (steps, values), abandoned, bad = split_curve(metric_rows, key)
            if not steps and not abandoned:
                continue
            drawn = True
            marker = "o" if len(steps) == 1 or key == "eval_loss" else None
            ax.plot(steps, values, style, color=color, label=run.name + (f" {suffix}" if suffix else ""),
                    marker=marker, markersize=3, linewidth=1.5)
            for a_steps, a_values in abandoned:
                ax.plot(a_steps, a_values, style, color=color, alpha=0.35, linewidth=1.2)
            if bad:
                ax.scatter(bad, [0.97] * len(bad), marker="x", color="red", s=40, zorder=5,
                           transform=ax.get_xaxis_transform(), label=None if marked_bad else "not finite (NaN/inf)")
                marked_bad = True
        for event in rs.events(run.records, "rollback"):
            ax.axvline(event["step"], color=color, linestyle=":", linewidth=1.2, alpha=0.8)
            ax.annotate("rollback", (event["step"], 0.03), xycoords=("data", "axes fraction"), rotation=90,
                        va="bottom", ha="right", fontsize=7, color=color)
    if not drawn:
        plt.close(fig)
        return False
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    if log_y:  # a spike of 1000x must not flatten the rest; labels 0.5, 2, 100 rather than 5x10^-1
        from matplotlib.ticker import FuncFormatter, NullFormatter
        ax.set_yscale("log")
        plain = FuncFormatter(lambda value, _: f"{value:g}")
        low, high = ax.get_ylim()
        ax.yaxis.set_major_formatter(plain)  # within 1.5 decades, label the 2..9 ticks too
        ax.yaxis.set_minor_formatter(plain if high / low < 10 ** 1.5 else NullFormatter())
    else:  # 1e-4 reads better than 0.0001 (lr); tokens/s stay plain up to a million
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 6))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def write_images(runs: list[RunData], directory: Path, prefix: str) -> list[tuple[str, Path]]:
    """The panels as PNGs in `directory`, named PREFIX-STEM.png; returns (title, path) of those drawn."""
    matplotlib = require_package("matplotlib", "dstrain report", "report")
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    written = []
    for stem, title, ylabel, series, log_y in PANELS:
        path = directory / f"{prefix}-{stem}.png"
        if _plot_panel(plt, runs, title, ylabel, series, log_y, path):
            written.append((title, path))
    return written


def summary_table(runs: list[RunData]) -> Table:
    table = Table()
    for column in ("run", "steps", "time", "tok/s", "MFU", "loss", "eval", "rollbacks", "checkpoint"):
        table.add_column(column, justify="left" if column in ("run", "checkpoint") else "right", no_wrap=True)
    for run in runs:
        s = run.summary
        # str cells are markup: the run's and the checkpoint's directory names are escaped
        table.add_row(outside(run.name), f"{s.first_step or 0}-{s.last_step}", rs.duration(s.train_seconds),
                      rs.fmt(s.tokens_per_s, ",.0f"), rs.fmt(s.mfu, ".1%"), rs.fmt(s.final_loss, ".4f"),
                      rs.fmt(s.final_eval_loss, ".4f"), str(s.rollbacks),
                      outside(s.last_checkpoint.name) if s.last_checkpoint else "-")
    return table


def expert_lines(runs: list[RunData]) -> list[str]:
    """A mixture-of-experts run's last logged load: "a: experts' load 1.42 (max/mean) at step 40, tokens per
    expert 120 98 ... (all layers)"; nothing for other runs."""
    lines = []
    for run in runs:
        last = next((r for r in reversed(run.records) if "expert_load" in r and "event" not in r), None)
        if last is not None:
            tokens = " ".join(str(t) for t in last.get("expert_tokens", []))
            balancing = f", balancing loss {last['aux_loss']:.4g}" if "aux_loss" in last else ""
            lines.append(f"{run.name}: experts' load {last['expert_load']:.3g} (max/mean) at step {last['step']}"
                         f"{balancing}" + (f", tokens per expert {tokens} (all layers)" if tokens else ""))
    return lines


def event_lines(runs: list[RunData]) -> list[str]:
    """Every event of every run but the session marks, in log order: "a: rollback at step 50: to_step=40"."""
    return [f"{run.name}: {rs.describe_event(e)}" for run in runs for e in rs.events(run.records)
            if e["event"] not in rs.SESSION_EVENTS]


def _html(runs: list[RunData], images: list[tuple[str, Path]]) -> str:
    rows = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in (
            r.name, f"{r.summary.first_step or 0}-{r.summary.last_step}", rs.duration(r.summary.train_seconds),
            rs.fmt(r.summary.tokens_per_s, ",.0f"), rs.fmt(r.summary.mfu, ".1%"), rs.fmt(r.summary.final_loss, ".4f"),
            rs.fmt(r.summary.final_eval_loss, ".4f"), str(r.summary.rollbacks),
            str(r.summary.last_checkpoint or "-"))) + "</tr>" for r in runs)
    figures = "".join(
        f'<figure><img alt="{html.escape(title)}" src="data:image/png;base64,'
        f'{base64.b64encode(path.read_bytes()).decode()}"><figcaption>{html.escape(title)}</figcaption></figure>'
        for title, path in images)
    head = ("<th>run</th><th>steps</th><th>time</th><th>tokens/s</th><th>MFU</th><th>loss</th><th>eval loss</th>"
            "<th>rollbacks</th><th>last checkpoint</th>")
    names = ", ".join(html.escape(r.name) for r in runs)
    events = event_lines(runs)
    event_list = ("<h2>Events</h2><ul>" + "".join(f"<li>{html.escape(line)}</li>" for line in events) + "</ul>"
                  if events else "")
    return ("<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>dstrain report: " + names + "</title>"
            "<style>body{font-family:sans-serif;margin:2em;max-width:60em}table{border-collapse:collapse}"
            "td,th{border:1px solid #ccc;padding:.3em .6em;text-align:right}td:first-child,td:last-child"
            "{text-align:left}img{max-width:100%}figure{margin:1.5em 0}</style></head><body>"
            f"<h1>dstrain report</h1><p>{names}</p><table><tr>{head}</tr>{rows}</table>{event_list}{figures}"
            "</body></html>\n")


def report(run_dirs: list[Path], output: Path | None, console: Console) -> Path:
    """Write the PNGs and the HTML page, print the table; returns the HTML path. Default output:
    RUN_DIR/report.html for one run, ./report.html for several."""
    runs = load_runs(run_dirs)
    output = output or (run_dirs[0] / "report.html" if len(run_dirs) == 1 else Path("report.html"))
    if output.suffix.lower() not in (".html", ".htm"):
        raise UserError.single("the report is an HTML page", f"-o {output}", "name it like report.html")
    if not output.parent.is_dir():
        raise UserError.single("no such directory", f"-o {output}", f"create {output.parent} first")
    images = write_images(runs, output.parent, output.stem)
    from dstrain.rundir import write_atomic
    write_atomic(output, _html(runs, images))
    wide = Console(highlight=False, width=max(console.width, 120), file=console.file)  # a pipe is 80 wide
    wide.print(summary_table(runs))
    for line in event_lines(runs):
        console.print(f"event {outside(line)}", soft_wrap=True)
    for line in expert_lines(runs):
        console.print(f"moe {outside(line)}", soft_wrap=True)
    for title, path in images:
        console.print(f"  {title}: {outside(path)}")
    console.print(f"report: {outside(output)}")
    return output
