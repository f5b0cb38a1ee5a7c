"""train.loss_chunking through the real launcher: 2 CPU ranks, ZeRO-3, a tiny hf: Qwen2 whose output head
is tied to its token embedding (the weight ZeRO-3 partitions and gathers for the embedding's forward, for
the head's and, chunked, for dstrain's LMHeadLoss as its external parameter). One run with the chunked
loss and one without, compared step by step: the step-1 loss checks the forward, the later steps the
gradients (the head's weight gradient included) that the optimizer applied. Tolerance 1e-5 relative
(fp32: the sums run in another order)."""

from __future__ import annotations

import json

import pytest

from hf_models import save_tiny_qwen2
from launcher import assert_ok, dstrain

pytest.importorskip("transformers")


def run(run_dir, model_dir, *sets: str):
    args = ["run", "--preset", "stage3", "--accelerator", "cpu", "--gpus", "2", "--run-dir", str(run_dir)]
    for item in (f"model.name=hf:{model_dir}", "data.tokenizer=byte", "data.seq_len=32", "train.micro_batch_size=2",
                 "train.max_steps=3", "train.lr=0.01", "train.warmup_steps=0", "train.log_every=1",
                 "train.eval_batches=1", "train.eval_every=1000", "train.save_checkpoints=false",
                 # every weight partitioned (none kept whole): the head's is gathered around each use
                 "deepspeed.zero_optimization.stage3_param_persistence_threshold=0", *sets):
        args += ["--set", item]
    return dstrain(*args)


@pytest.mark.integration
def test_zero3_tied_qwen2_trains_chunked_exactly_as_with_the_whole_logits(tmp_path):
    model_dir = save_tiny_qwen2(tmp_path / "qwen2")
    chunked = run(tmp_path / "chunked", model_dir, "train.loss_chunking=true", "train.loss_chunk_tokens=24")
    assert_ok(chunked)
    assert "LM loss in chunks of 24 tokens" in chunked.stdout  # 64 tokens a rank: chunks of 24, 24 and 16
    whole = run(tmp_path / "whole", model_dir, "train.loss_chunking=false")
    assert_ok(whole)
    assert "LM loss in chunks" not in whole.stdout
    on, off = _rows(tmp_path / "chunked"), _rows(tmp_path / "whole")
    assert sorted(on) == sorted(off) == [1, 2, 3]
    for step in (1, 2, 3):  # the loss of each step, and the global gradient norm DeepSpeed measured
        for key in ("loss", "grad_norm"):
            assert on[step][key] == pytest.approx(off[step][key], rel=1e-5), (step, key)
    assert on[3]["eval_loss"] == pytest.approx(off[3]["eval_loss"], rel=1e-5)
    assert on[3]["eval_loss"] < on[1]["loss"] - 0.3  # it trains (2 updates at lr 0.01; the first step's lr is 0)


def _rows(run_dir) -> dict[int, dict]:
    """step -> the step's metrics, its evaluation merged in."""
    rows: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "event" not in row:
            rows.setdefault(row["step"], {}).update(row)
    return rows
