"""`dstrain report` and the end-of-run summary, from synthetic metrics.jsonl files shaped like the ones
rank 0 writes (dstrain/rank/metrics.py): PNGs, one self-contained HTML page, the console table, the
summary text and the next commands, bad input."""

from __future__ import annotations

import base64
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dstrain.cli import app
from dstrain.run_summary import next_commands, summarize, summary_lines
from dstrain.tools.report import split_curve

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(run_dir: Path, steps: int = 40, rollback_at: int | None = None, speed: float = 10_000.0,
              mfu: float | None = None, resumed_at: int | None = None) -> Path:
    """A run's metrics.jsonl: log every 5 steps, eval every 20; with rollback_at, a NaN loss 10 steps later,
    a rollback event back to rollback_at and the steps trained again; with resumed_at, a second session."""
    run_dir.mkdir(parents=True, exist_ok=True)
    rows, clock, step = [], 1000.0, 0
    rows.append({"event": "run_start", "step": 0, "max_steps": steps, "world_size": 2, "time": clock})
    rolled = False
    while step < steps:
        step += 5
        clock += 2.0
        row = {"step": step, "loss": 5.0 * math.exp(-step / 30) + 1.0, "lr": 1e-3, "grad_norm": 2.0 - step / 40,
               "tokens_per_s": speed + step, "tflops_per_device": 0.1, "data_wait_ms": 1.0, "step_time_ms": 50.0,
               "memory_gib": 1.0, "host_rss_gib": 0.5 + step / 1000, "time": clock}
        if mfu is not None:
            row["mfu"] = mfu
        bad = rollback_at is not None and not rolled and step == rollback_at + 10
        if bad:
            row["loss"], row["grad_norm"] = float("nan"), float("inf")
        rows.append(row)
        if step % 20 == 0:
            rows.append({"step": step, "eval_loss": row["loss"] + 0.25, "time": clock})
        if bad:
            rows.append({"event": "rollback", "step": step, "to_step": rollback_at, "time": clock})
            step, rolled = rollback_at, True
        if resumed_at is not None and step == resumed_at + 5:  # killed here; resumed from resumed_at
            rows.append({"event": "run_start", "step": resumed_at, "max_steps": steps, "world_size": 2, "time": clock})
            step, resumed_at = resumed_at, None
    rows.append({"event": "run_end", "step": steps, "stopped_by": None, "time": clock + 1})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def write_checkpoint(run_dir: Path, step: int) -> Path:
    """A checkpoint folder with dstrain's completion mark (no shards: the summary reads only the mark)."""
    tag_dir = run_dir / "checkpoints" / f"step{step:08d}"
    tag_dir.mkdir(parents=True)
    (tag_dir / "dstrain_complete.json").write_text(json.dumps({"step": step, "world_size": 2, "files": [],
                                                               "time": 1000.0 + step}))
    return tag_dir


def test_report_on_two_runs_writes_pngs_and_one_html_page_embedding_them(tmp_path):
    a = write_run(tmp_path / "a", rollback_at=20)
    b = write_run(tmp_path / "b", speed=12_000.0)
    out = tmp_path / "out" / "compare.html"
    out.parent.mkdir()
    result = CliRunner().invoke(app, ["report", str(a), str(b), "-o", str(out)])

    assert result.exit_code == 0, result.output
    pngs = sorted(p.name for p in out.parent.glob("*.png"))
    assert pngs == ["compare-grad_norm.png", "compare-loss.png", "compare-lr.png", "compare-memory.png",
                    "compare-throughput.png"]
    page = out.read_text()
    embedded = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(embedded) == 5 and all(base64.b64decode(e).startswith(PNG_MAGIC) for e in embedded)
    assert "src=\"http" not in page and "<link" not in page  # self-contained
    assert (out.parent / "compare-loss.png").read_bytes() == base64.b64decode(embedded[0])  # same images
    assert ">a<" in page and ">b<" in page
    assert "<li>a: rollback at step 30: to_step=20</li>" in page  # the event list names each rollback


def test_report_console_table_has_one_row_per_run_with_speed_losses_and_rollbacks(tmp_path):
    a = write_run(tmp_path / "a", rollback_at=20, mfu=0.42)
    b = write_run(tmp_path / "b", speed=12_000.0)
    write_checkpoint(b, 40)
    result = CliRunner().invoke(app, ["report", str(a), str(b), "-o", str(tmp_path / "r.html")])

    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in result.output.splitlines() if line.startswith("│")}
    # steps, time, tok/s, MFU, loss, eval, rollbacks, checkpoint
    assert rows["a"][3] == "42.0%" and rows["a"][6] == "1" and rows["a"][7] == "-"
    assert rows["b"][0] == "0-40" and rows["b"][3] == "-" and rows["b"][6] == "0" and rows["b"][7] == "step00000040"
    assert rows["b"][2] == "12,022"  # the median of 12,005 .. 12,040
    assert rows["b"][4] == f"{5.0 * math.exp(-40 / 30) + 1.0:.4f}"
    assert "event a: rollback at step 30: to_step=20" in result.output


def test_report_of_one_run_defaults_to_report_html_in_its_run_directory(tmp_path):
    run = write_run(tmp_path / "run")
    result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    assert (run / "report.html").is_file() and (run / "report-loss.png").read_bytes().startswith(PNG_MAGIC)


def test_split_curve_keeps_the_line_the_run_went_on_with_and_fades_the_abandoned_stretch():
    rows = [{"step": s, "loss": v} for s, v in [(5, 3.0), (10, 2.0), (15, float("nan")), (10, 2.1), (15, 1.9)]]
    kept, abandoned, bad = split_curve(rows, "loss")
    assert kept == ([5, 10, 15], [3.0, 2.1, 1.9])
    assert len(abandoned) == 1 and abandoned[0][0] == [5, 10, 15]  # branches off at step 5
    assert bad == [15]


@pytest.mark.parametrize("case", ["missing", "no_metrics", "empty"])
def test_report_on_bad_input_exits_2_naming_the_directory(tmp_path, case):
    run = tmp_path / "run"
    if case != "missing":
        run.mkdir()
    if case == "empty":
        (run / "metrics.jsonl").write_text(json.dumps({"event": "run_start", "step": 0, "time": 1.0}) + "\n")
    result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code == 2
    message = {"missing": "no such run directory", "no_metrics": "no metrics.jsonl here",
               "empty": "metrics.jsonl holds no logged step yet"}[case]
    assert message in result.output and str(run) in result.output
    assert not list(tmp_path.rglob("*.png")) and not list(tmp_path.rglob("*.html"))


def test_report_without_matplotlib_exits_2_naming_the_extra(tmp_path, monkeypatch):
    run = write_run(tmp_path / "run")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # how Python blocks an import
    result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code == 2
    assert "matplotlib is not installed" in result.output and "pip install 'dstrain[report]'" in result.output


@pytest.mark.slow
def test_report_imports_neither_torch_nor_deepspeed(tmp_path):
    run = write_run(tmp_path / "run")
    code = ("import sys; from typer.testing import CliRunner; from dstrain.cli import app; "
            f"r = CliRunner().invoke(app, ['report', {str(run)!r}]); assert r.exit_code == 0, r.output; "
            "print(sorted(m for m in ('torch', 'deepspeed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_summary_names_steps_speed_losses_rollbacks_and_the_last_complete_checkpoint(tmp_path):
    run = write_run(tmp_path / "run", rollback_at=20, mfu=0.4)
    tag_dir = write_checkpoint(run, 40)
    text = "\n".join(summary_lines(summarize(run), wall_seconds=125.0))
    assert text.startswith("summary: 40 steps, wall time 2m05s (training ")
    assert "MFU 40.0%" in text and "rollbacks 1" in text
    assert f"final loss {5.0 * math.exp(-40 / 30) + 1.0:.4f}, eval loss {5.0 * math.exp(-40 / 30) + 1.25:.4f}" in text
    assert f"last complete checkpoint: {tag_dir}" in text


def test_summary_of_a_resumed_run_covers_its_last_session(tmp_path):
    run = write_run(tmp_path / "run", resumed_at=20)
    summary = summarize(run)
    assert (summary.first_step, summary.last_step) == (20, 40)
    assert summary_lines(summary)[0].startswith("summary: steps 20-40, training time ")


def test_next_commands_fill_in_the_runs_own_paths(tmp_path):
    run = write_run(tmp_path / "my run")
    write_checkpoint(run, 40)
    commands = next_commands(summarize(run), accelerator="cpu")
    quoted = f"'{run}'"
    assert commands == [f"dstrain eval --run-dir {quoted} --accelerator cpu",
                        f"dstrain convert-checkpoint '{run}/checkpoints' '{run}/model.safetensors'",
                        f"dstrain report {quoted} -o '{run}/report.html'"]


def test_next_commands_without_a_checkpoint_offer_only_the_report(tmp_path):
    run = write_run(tmp_path / "run")
    assert next_commands(summarize(run)) == [f"dstrain report {run} -o {run}/report.html"]
