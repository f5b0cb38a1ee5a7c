"""No user text is markup (issue 54, item 1): text from a user, a file, a command line, the environment or
another library's exception is printed exactly as written, and never crashes a command.

A multi-node run died with rich's MarkupError: its lock note quoted `--set data.paths=[/data/chat.jsonl]`
and rich read `[/data/chat.jsonl]` as a closing tag. Here text like `[/x]`, `[bold]`, `[red]` and
`[link=https://example.com]x[/link]` goes through every printing path reachable in this process (the
commands themselves through Typer's CliRunner, or the printing function with real objects), and the
output must hold it verbatim. Nothing here starts a rank.
"""

from __future__ import annotations

import glob
import io
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console
from typer.testing import CliRunner

from dstrain.cli import app
from dstrain.console_text import outside
from dstrain.rundir import CHECKPOINTS, LOCK

ISSUE = "data.paths=[/data/chat.jsonl]"  # the --set value of the issue's command line
MARKUP = "[/x] [bold] [link=https://example.com]x[/link] [red]"
WIDE = {"COLUMNS": "1000"}  # no line of interest is wrapped


def marked(root: Path, name: str = "dir") -> Path:
    """A directory whose path reads `[bold] [red] [link=https:/example.com]x[/link] [/x] NAME` (a path has
    no '//', and its '/' separators close the tags)."""
    path = root / "[bold] [red] [link=https:" / "example.com]x[" / "link] [" / f"x] {name}"
    path.mkdir(parents=True)
    return path


def flat(text: str) -> str:
    return " ".join(text.split())


def cli(*args: str, env: dict | None = None):
    result = CliRunner().invoke(app, list(args), env={**WIDE, **(env or {})})
    assert "Traceback" not in result.output and "MarkupError" not in repr(result.exception), result.output
    return result


# ------------------------------------------------------------------ the helper


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["[", "]", "/", "\\", ":", "x", " ", "red", "fire", "bold", "link=", "\n",
                                 "[/x]", "[bold]", "[red]", "[link=https://example.com]", ":fire:", "@"]),
                max_size=12).map("".join))
def test_outside_text_prints_as_written_around_dstrains_own_markup(text):
    # rich.markup.escape alone drops the backslash of '\[1]', turns ':fire:' into an emoji and lets a
    # trailing backslash escape the closing tag after it: outside() covers those too.
    out = io.StringIO()
    console = Console(file=out, width=1000, highlight=False, color_system=None)
    console.print(f"[yellow]note:[/] {outside(text)}", soft_wrap=True)
    console.print(f"[bold red]{outside(text)}[/]{outside(text)}", soft_wrap=True)
    console.print(outside(text), soft_wrap=True)
    assert out.getvalue() == f"note: {text}\n{text}{text}\n{text}\n"


# ------------------------------------------------------------------ errors, config, the plan


def test_an_error_quoting_a_set_value_prints_it_as_written():
    result = cli("config", "--set", f"train.lr={MARKUP}")
    assert result.exit_code == 2
    assert f"--set: train.lr: Input should be a valid number, unable to parse string as a number (got {MARKUP!r})" \
        in result.output
    result = cli("presets", MARKUP)
    assert result.exit_code == 2 and f"unknown preset {MARKUP!r}" in result.output


@pytest.fixture
def config_file(tmp_path):
    """A config in a marked directory that draws a warning naming the file."""
    path = marked(tmp_path, "config") / "run.yaml"
    path.write_text("train:\n  max_steps: 5\n  warmup_steps: 10\n")
    return path


def test_config_warnings_and_explain_print_the_files_path(config_file):
    result = cli("config", "--preset", "stage2", "--accelerator", "cpu", "--gpus", "1", "--config", str(config_file),
                 "--explain", "--set", ISSUE)
    assert result.exit_code == 0, result.output
    assert f"warning: --config {config_file}: train.warmup_steps: warmup of 10 steps" in result.output
    assert '["/data/chat.jsonl"]' in result.output and f"--config {config_file}" in result.output


def save_tags(run_dir: Path, *steps: int, config_hash: str) -> Path:
    """Tags written by the real checkpointing.save (in a one-rank gloo group); a stand-in for DeepSpeed's
    engine writes its shard files, as in test_checkpoint_integrity.py."""
    from dstrain.rank.checkpointing import save

    class Shards:
        def save_checkpoint(self, directory, tag, client_state, save_latest):
            (Path(directory) / tag).mkdir(parents=True, exist_ok=True)
            (Path(directory) / tag / "mp_rank_00_model_states.pt").write_bytes(b"m" * 1000)
            (Path(directory) / tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"o" * 3000)

    for step in steps:
        save(Shards(), run_dir, step, {"config_hash": config_hash}, keep_last=5, hashes=True)
    return run_dir / CHECKPOINTS


def test_dry_run_prints_the_warning_plan_resume_run_directory_and_command(tmp_path, config_file, one_rank_group):
    from dstrain.config.resolve import resolve
    run_dir = marked(tmp_path, "run")
    args = ["--preset", "stage2", "--accelerator", "cpu", "--gpus", "1", "--config", str(config_file)]
    checkpoints = save_tags(run_dir, 2, config_hash=resolve("stage2", config_file, accelerator="cpu").config_hash())
    result = cli("run", *args, "--run-dir", str(run_dir), "--resume", "latest", "--dry-run")
    assert result.exit_code == 0, result.output
    assert f"warning: --config {config_file}: train.warmup_steps" in result.output
    assert f"resume: step00000002 (step 2) from {checkpoints.resolve()}\n" in result.output
    assert f"run directory: {run_dir} (not written: --dry-run)\n" in result.output
    assert f"--module dstrain.rank.worker {shlex.quote(str(run_dir.resolve()))}\n" in result.output


def test_dry_run_warns_of_the_running_job_quoting_its_command_line(tmp_path, monkeypatch):
    from dstrain.launcher.ownership import Holder, acquire
    run_dir = marked(tmp_path, "run")
    # The job holding the directory was started with the issue's command line (as this process, here).
    monkeypatch.setattr(sys, "argv", ["dstrain", "run", "--set", ISSUE, "--set", f"model.name={MARKUP}"])
    lock = acquire(run_dir, "--run-dir")
    try:
        holder = Holder.parse((run_dir / LOCK).read_text())
        assert ISSUE in holder.command
        result = cli("run", "--preset", "stage2", "--accelerator", "cpu", "--gpus", "1", "--run-dir", str(run_dir),
                     "--dry-run")
    finally:
        lock.release()
    assert result.exit_code == 0, result.output
    assert f"warning: the run directory belongs to a running job ({holder.describe()}): this run would be " \
           "refused" in result.output


def test_the_note_of_a_taken_over_lock_quotes_the_gone_jobs_command_line(tmp_path):
    """The issue's crash: `[yellow]note:[/] {lock.note}` with the note quoting `--set data.paths=[...]`."""
    from dstrain.launcher.ownership import Holder
    from dstrain.rundir import CONFIG, write_atomic
    run_dir = marked(tmp_path, "run")
    # A job that took the lock and is gone: its details stay in the lock file.
    code = ("import sys; from pathlib import Path; from dstrain.launcher.ownership import acquire; "
            f"sys.argv = ['dstrain', 'run', '--set', {ISSUE!r}, '--set', {('model.name=' + MARKUP)!r}]; "
            "acquire(Path(sys.stdin.readline().strip()), '--run-dir')")
    subprocess.run([sys.executable, "-c", code], input=f"{run_dir}\n", text=True, check=True, timeout=60,
                   env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    gone = Holder.parse((run_dir / LOCK).read_text())
    assert ISSUE in gone.command
    # The run stops right after printing the note, before any rank exists: its config.yaml cannot be
    # written (a directory stands there). Checked first, so this test can never start ranks.
    (run_dir / CONFIG).mkdir()
    with pytest.raises(OSError):
        write_atomic(run_dir / CONFIG, "")
    result = cli("run", "--preset", "stage2", "--accelerator", "cpu", "--gpus", "1", "--run-dir", str(run_dir),
                 env={"DSTRAIN_EARLY_START": "0"})
    assert result.exit_code == 2 and "cannot write the run directory" in result.output, result.output
    assert f"note: took over the run directory from a job that is gone ({gone.describe()})\n" in result.output


# ------------------------------------------------------------------ a Hugging Face model in a marked folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    from hf_models import save_tiny_llama
    from tiny_tokenizer import build_tokenizer
    return build_tokenizer(save_tiny_llama(marked(tmp_path_factory.mktemp("llama"), "model"), vocab_size=320))


def test_the_plan_names_a_model_in_a_marked_folder(model_dir, tmp_path):
    result = cli("run", "--preset", "stage2", "--accelerator", "cpu", "--gpus", "1", "--run-dir",
                 str(tmp_path / "run"), "--set", f"model.name=hf:{model_dir}", "--dry-run")
    assert result.exit_code == 0, result.output
    assert f"model: hf:{model_dir}, " in result.output


def test_generate_names_the_marked_folder_and_completes_a_marked_prompt(model_dir):
    result = cli("generate", str(model_dir), "--prompt", MARKUP, "--max-new-tokens", "2")
    assert result.exit_code == 0, result.output
    loaded = [line for line in result.output.splitlines() if line.endswith(", on cpu")]
    assert len(loaded) == 1 and str(model_dir) in loaded[0], result.output


# ------------------------------------------------------------------ data, checkpoints, reports


def test_data_preview_prints_the_paths_warnings_and_rows_as_written(tmp_path, config_file):
    # data.paths are glob patterns: a file in a marked directory is named with its brackets escaped,
    # and the pattern is printed as the user wrote it.
    data = marked(tmp_path, "data") / "qa.jsonl"
    pattern = glob.escape(str(data))
    rows = [{"prompt": f"{MARKUP} {i}?\n", "response": f"{MARKUP}."} for i in range(12)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = cli("data", "preview", "--config", str(config_file), "--set", "data.source=jsonl",
                 "--set", f"data.paths=[{json.dumps(pattern)}]", "--set", f"data.cache_dir={tmp_path / 'cache'}",
                 "--set", "data.tokenizer=byte", "--set", "data.format=prompt_response", "--set", "data.seq_len=128")
    assert result.exit_code == 0, result.output
    assert f"warning: --config {config_file}: train.warmup_steps" in result.output
    assert f"data: jsonl {pattern}; format prompt_response, tokenizer byte, seq_len 128\n" in result.output
    # the first training example (which row it is depends on the held-out split), its response marked
    assert re.search(re.escape(MARKUP) + r" \d+\?\n⟦" + re.escape(f"{MARKUP}.<eos>⟧"), result.output), result.output


def test_checkpoint_verify_prints_the_directory_and_the_damage_as_written(tmp_path, one_rank_group):
    run_dir = marked(tmp_path, "run")
    checkpoints = save_tags(run_dir, 2, 4, config_hash="h")
    shard = checkpoints / "step00000004" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    shard.write_bytes(b"o" * 10)
    result = cli("checkpoint", "verify", str(run_dir))
    assert result.exit_code == 2, result.output
    # the table's title, wrapped to its width (rich folds a word longer than a line anywhere, even inside "[bold]")
    assert "".join(f"checkpoints in {checkpoints}".split()) in "".join(result.output.split())
    assert f"damaged: {shard} truncated: 10 bytes, the mark recorded 3000" in result.output
    assert f"intact tag(s) in {checkpoints}; resume from an intact tag" in result.output
    result = cli("checkpoint", "verify", str(checkpoints / "step00000004"))
    assert f"{checkpoints / 'step00000004'}: not safe to resume from or convert:" in result.output


def write_metrics(run_dir: Path, start: float) -> None:
    """metrics.jsonl as rank 0 writes it: a session, logged steps, an eval, a rollback naming its reason."""
    rows = [{"event": "run_start", "step": 0, "max_steps": 20, "world_size": 1, "time": start}]
    for step in range(5, 25, 5):
        rows.append({"step": step, "loss": 3.0 - step / 10, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1000.0,
                     "tflops_per_device": 0.1, "step_time_ms": 50.0, "memory_gib": 1.0, "time": start + step})
    rows.append({"step": 20, "eval_loss": 1.5, "time": start + 20})
    rows.append({"event": "rollback", "step": 15, "to_step": 10, "reason": MARKUP, "time": start + 15})
    rows.append({"event": "run_end", "step": 20, "stopped_by": None, "time": start + 21})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tag = run_dir / CHECKPOINTS / "step00000020"
    tag.mkdir(parents=True)
    (tag / "dstrain_complete.json").write_text(json.dumps({"step": 20, "world_size": 1, "files": [],
                                                          "time": start + 20}))


def test_the_end_of_run_summary_prints_the_run_directorys_paths(tmp_path):
    from dstrain.launcher.job import _print_summary
    run_dir = marked(tmp_path, "run")
    started = time.time()
    write_metrics(run_dir, started + 1)
    out = io.StringIO()
    _print_summary(run_dir, started, "cpu", Console(file=out, width=1000, highlight=False))
    text = out.getvalue()
    assert f"last complete checkpoint: {run_dir / CHECKPOINTS / 'step00000020'}\n" in text
    assert f"  dstrain eval --run-dir {shlex.quote(str(run_dir))} --accelerator cpu\n" in text
    assert f"  dstrain report {shlex.quote(str(run_dir))} -o {shlex.quote(str(run_dir / 'report.html'))}\n" in text


def test_report_prints_the_run_name_events_and_paths(tmp_path):
    pytest.importorskip("matplotlib")
    from dstrain.tools.report import event_lines, load_runs
    run_dir = marked(tmp_path, "run")
    write_metrics(run_dir, 1000.0)
    output = run_dir / "r.html"
    result = cli("report", str(run_dir), "-o", str(output))
    assert result.exit_code == 0, result.output
    events = event_lines(load_runs([run_dir]))
    assert any(MARKUP in line for line in events)
    for line in events:
        assert f"event {line}\n" in result.output
    assert f"│ {run_dir.name} " in result.output and f"report: {output}\n" in result.output


def test_doctor_prints_the_paths_and_problems_as_written(tmp_path, monkeypatch):
    from dstrain.tools import doctor
    extensions = marked(tmp_path, "ops")
    lock = extensions / "cpu_adam" / "lock"
    lock.parent.mkdir()
    lock.write_text("")
    os.utime(lock, (time.time() - 3600, time.time() - 3600))  # left by a killed build: a problem naming it
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions))
    report = doctor.collect(nvme_path=marked(tmp_path, "nvme") / "missing")
    out = io.StringIO()
    doctor.render(report, Console(file=out, width=1000))  # what `dstrain doctor` prints
    text = out.getvalue()
    assert {"extension_locks", "nvme"} <= {p["check"] for p in report["problems"]}
    for problem in report["problems"]:
        assert problem["message"] in text and problem["fix"] in text
    assert f"Op build cache: {extensions} (TORCH_EXTENSIONS_DIR, as you set it)" in text
    assert report["nvme"]["path"] in text


def test_the_notes_on_the_environment_quote_its_values_as_written(tmp_path, monkeypatch, capsys):
    from dstrain.launcher.env_fixes import sanitize_cuda_arch_list
    from dstrain.launcher.preflight import clear_stale_build_locks
    from dstrain.launcher.runner import rank_env
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", f"9.0a;{MARKUP}")
    monkeypatch.setenv("COLUMNS", "1000")
    rank_env("cpu", 1)
    _, note = sanitize_cuda_arch_list(os.environ)
    assert MARKUP in note and f"note: {note}\n" in capsys.readouterr().err
    extensions = marked(tmp_path, "ops")
    lock = extensions / "async_io" / "lock"
    lock.parent.mkdir()
    lock.write_text("")
    os.utime(lock, (time.time() - 3600, time.time() - 3600))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions))
    out = io.StringIO()
    clear_stale_build_locks(Console(file=out, width=1000, highlight=False), dry_run=True)
    assert f"note: stale op build lock {lock} (left by a killed build); a run removes it" in out.getvalue()


def test_estimate_with_a_config_in_a_marked_directory(config_file):
    result = cli("estimate", "--params", "1e8", "--gpus", "1", "--gpu-mem", "16", "--cpu-mem", "32", "--config",
                 str(config_file))
    assert result.exit_code == 0, result.output
    assert "recommended:" in result.output or "nothing fits" in result.output


@pytest.mark.parametrize("command", ["eval", "convert-checkpoint"])
def test_eval_and_convert_name_a_marked_directory_that_holds_no_run(tmp_path, command):
    where = marked(tmp_path, "nothing")
    args = ["eval", "--run-dir", str(where)] if command == "eval" else \
        ["convert-checkpoint", str(where), str(tmp_path / "out.safetensors")]
    result = cli(*args)
    assert result.exit_code == 2 and str(where) in result.output, result.output


# ------------------------------------------------------------------ while the ranks run


def test_the_hang_report_prints_the_host_stack_and_latest_tag_as_written(tmp_path):
    from dstrain.hangs import Beat, judge
    from dstrain.launcher.watchdog import report
    run_dir = marked(tmp_path, "run")
    (run_dir / CHECKPOINTS).mkdir()
    (run_dir / CHECKPOINTS / "latest").write_text(MARKUP)
    now = time.time()
    verdict = judge({0: Beat(0, 100, MARKUP, "forward", 5, 1, now - 50)}, now, timeout_s=20)
    stack = f'  File "{MARKUP}.py", line 3 in wait_forever'
    out = io.StringIO()
    console = Console(file=out, width=1000, highlight=False)
    for line in report(verdict, stack, run_dir):
        console.print(line, soft_wrap=True)
    text = out.getvalue()
    assert f"(pid 100 on {MARKUP})" in text and f"\n  {stack}\n" in text
    assert f"every rank's in {run_dir / 'ranks'}/rank*.stack" in text
    assert f"the last complete checkpoint {MARKUP} stays `latest`" in text


def test_a_failed_ranks_exception_is_printed_as_written(tmp_path):
    from dstrain.launcher.supervise import _job_exit_code
    from dstrain.rundir import RANKS
    run_dir = marked(tmp_path, "run")
    (run_dir / RANKS).mkdir()
    (run_dir / RANKS / "rank0.pid").write_text("123")
    (run_dir / RANKS / "rank0.exit").write_text(f"failed: RuntimeError: cannot open {MARKUP}")
    out = io.StringIO()
    assert _job_exit_code(1, None, True, run_dir, set(), Console(file=out, width=1000, highlight=False)) == 1
    assert f"rank 0 failed first: RuntimeError: cannot open {MARKUP}\n" in out.getvalue()
    assert f"full log: {run_dir / RANKS}" in out.getvalue()


def test_rank_zeros_notes_print_as_written(tmp_path, capsys):
    import torch
    from dstrain.rank.metrics import MetricsLog
    metrics = MetricsLog(tmp_path, True, 10, 100, 1.0, 1, torch.device("cpu"))
    try:
        metrics.note(f"checkpoint {MARKUP} saved")
    finally:
        metrics.close()
    assert f"checkpoint {MARKUP} saved" in capsys.readouterr().out
