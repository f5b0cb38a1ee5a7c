"""`dstrain data preview`: counts, lengths, packing efficiency and marked examples, with no rank started."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

from dstrain.cli import app


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def preview(tmp_path, rows, *sets):
    data = write_rows(tmp_path / "qa.jsonl", rows)
    args = ["data", "preview", "--set", "data.source=jsonl", "--set", f"data.paths=[{data}]",
            "--set", f"data.cache_dir={tmp_path / 'cache'}", "--set", "data.tokenizer=byte"]
    for item in sets:
        args += ["--set", item]
    return CliRunner().invoke(app, args, env={"COLUMNS": "300"})


def test_preview_counts_kept_cut_dropped_and_held_out_and_marks_the_trained_tokens(tmp_path):
    rows = [{"prompt": f"Question {i}?\n", "response": "Answer." * (i % 5 + 1)} for i in range(18)]
    rows += [{"prompt": "P" * 70 + "?\n", "response": "cut off"}]  # no response token left within seq_len
    rows += [{"prompt": "Long?\n", "response": "x" * 100}]  # cut to seq_len, still learns
    result = preview(tmp_path, rows, "data.format=prompt_response", "data.seq_len=64", "data.eval_fraction=0.1")
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert "rows read 20" in out
    assert "examples kept 19: 17 to train on, 2 held out" in out
    assert "cut to seq_len 2 (the longest had 107 tokens)" in out
    assert "left out 1 (no response or assistant token left within seq_len)" in out
    lengths = [len(f"Question {i}?\n") + 7 * (i % 5 + 1) + 1 for i in range(18)] + [64]
    assert f"min {min(lengths)}" in out and f"p50 {np.percentile(lengths, 50):,.0f}" in out and "max 64" in out
    padded = sum(lengths[:17]) / (17 * 64)
    assert f"17 rows one example each: {padded:.1%}" in out
    assert "packing on (data.packing auto)" in out and "rows packed:" in out
    assert "Question 0?\n⟦Answer.<eos>⟧" in result.output  # the first training example, its response marked


def test_preview_of_preference_pairs_shows_prompt_chosen_rejected_and_the_packing_of_whole_pairs(tmp_path):
    rows = [{"prompt": f"Q{i}? ", "chosen": "yes" * (i % 3 + 1), "rejected": "no"} for i in range(19)]
    rows += [{"prompt": "P" * 70, "chosen": "c", "rejected": "r"}]  # no completion token left: dropped whole
    result = preview(tmp_path, rows, "data.format=preference", "train.objective=dpo", "data.seq_len=64",
                     "data.eval_fraction=0.1")
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert "rows read 20" in out and "kept 19: 19 pairs, 0 unpaired (KTO); 17 to train on, 2 held out" in out
    assert "left out 1 (a completion with no token left within seq_len)" in out
    assert "rows of whole pairs packed:" in out and "34 rows one example each:" in out
    assert "prompt: Q0? chosen (4 scored): ⟦yes<eos>⟧ rejected (3 scored): ⟦no<eos>⟧" in out


def test_preview_of_a_token_stream_says_there_are_no_examples(tmp_path):
    result = CliRunner().invoke(app, ["data", "preview", "--set", "data.source=corpus"])
    assert result.exit_code == 2 and "no examples to preview" in result.output


def test_data_help_imports_neither_torch_nor_deepspeed():
    code = ("import sys; from typer.testing import CliRunner; from dstrain.cli import app; "
            "r = CliRunner().invoke(app, ['data', 'preview', '--help']); assert r.exit_code == 0, r.output; "
            "print(sorted(m for m in ('torch', 'deepspeed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
