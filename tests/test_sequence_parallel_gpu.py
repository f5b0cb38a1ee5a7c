"""Sequence parallelism on GPUs through the real launcher (skipped without 2 CUDA devices): the CPU tests'
equality (tests/test_sequence_parallel.py) with NCCL, GPU attention kernels and longer sequences. A tiny
Llama, 2 GPUs with train.sequence_parallel=2 against 1 GPU without it, the same batches of 2048 tokens,
SGD at lr 1 with no clipping (the weight change is the gradient).

- fp32, sdpa: losses, gradient norms and eval loss rel 1e-4, final weights abs 1e-4 (the kernels sum in
  another order on a share than on the whole sequence);
- bf16, sdpa and (where flash-attn is installed) flash_attention_2: losses rel 2e-2, gradient norms rel 5e-2
  (bf16 rounding of 1 part in 256 on every activation).

Run it on a GPU machine: `pytest tests/test_sequence_parallel_gpu.py` (about 1 minute per case, a few GiB of
GPU memory)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from hf_models import save_tiny_llama
from launcher import assert_ok, dstrain

pytestmark = pytest.mark.integration
if torch.cuda.device_count() < 2:  # before the imports below, so a CPU machine says why it skips
    pytest.skip("sequence parallelism on GPUs needs 2 CUDA devices", allow_module_level=True)
pytest.importorskip("transformers")

from test_sequence_parallel import SGD, by_step, final_weights, records  # noqa: E402

ATTENTION = ["sdpa"] + (["flash_attention_2"] if importlib.util.find_spec("flash_attn") else [])


def run(run_dir, gpus: int, sets: tuple[str, ...]):
    args = ["run", "--preset", "stage3", "--accelerator", "cuda", "--gpus", str(gpus), "--run-dir", str(run_dir)]
    for item in sets:
        args += ["--set", item]
    return dstrain(*args)


@pytest.mark.parametrize("precision,attention", [("fp32", "sdpa")] + [("bf16", a) for a in ATTENTION])
def test_two_gpus_splitting_each_sequence_train_as_one_gpu_does(tmp_path, precision, attention):
    model_dir = save_tiny_llama(tmp_path / "llama")
    sets = (f"model.name=hf:{model_dir}", "model.kwargs.max_position_embeddings=2048",
            f"model.kwargs.attn_implementation={attention}", f"train.precision={precision}", "data.tokenizer=byte",
            "data.seq_len=2048", "train.micro_batch_size=1", "train.max_steps=3", "train.log_every=1",
            "train.eval_batches=1", "train.eval_every=3", "train.save_every=3", "train.export_final=true",
            "train.compile=false", *SGD)
    split, whole = tmp_path / "split", tmp_path / "whole"
    assert_ok(run(split, 2, (*sets, "train.sequence_parallel=2")))
    assert_ok(run(whole, 1, sets))
    tight = precision == "fp32"
    for key, rel in (("loss", 1e-4 if tight else 2e-2), ("grad_norm", 1e-4 if tight else 5e-2),
                     ("eval_loss", 1e-4 if tight else 2e-2)):
        a, b = by_step(records(split), key), by_step(records(whole), key)
        assert a and sorted(a) == sorted(b), key
        for step in a:
            assert a[step] == pytest.approx(b[step], rel=rel), (key, step)
    if tight:
        mine, theirs = final_weights(split), final_weights(whole)
        for name in mine:
            torch.testing.assert_close(mine[name].float(), theirs[name].float(), rtol=0, atol=1e-4, msg=name)
