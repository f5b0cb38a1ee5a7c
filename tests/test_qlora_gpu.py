"""QLoRA on a GPU through the real launcher (skipped without CUDA or bitsandbytes): a tiny Llama loaded in
4-bit NormalFloat trains LoRA adapters for a few steps at ZeRO-2 (bf16, on up to 2 GPUs), only the adapters reach the
optimizer, the adapter export loads in peft on the base model, the merged export is refused with the
fix, and `dstrain generate` answers from the run directory.

Run it on a GPU machine: `pytest tests/test_qlora_gpu.py`. Passed 2026-11-26 on one H200 (56 s, FusedAdam
already built) and on two H200s (95 s), torch 2.11.0+cu130, DeepSpeed 0.19.8, transformers 5.17.0,
peft 0.21.0, bitsandbytes 0.50.2."""

from __future__ import annotations

import math

import pytest
import torch

from hf_models import save_tiny_llama
from launcher import assert_ok, dstrain, losses

from dstrain import rundir

pytestmark = pytest.mark.integration
if not torch.cuda.is_available():  # before the imports below, so a CPU machine says why it skips
    pytest.skip("QLoRA needs a CUDA GPU (bitsandbytes' 4-bit kernels)", allow_module_level=True)
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")


def test_qlora_trains_adapters_on_a_4bit_base_and_exports_them_for_peft(tmp_path):
    from tiny_tokenizer import build_tokenizer

    from dstrain.tools.convert.reader import open_checkpoint
    model_dir = build_tokenizer(save_tiny_llama(tmp_path / "llama", vocab_size=320))
    run_dir = tmp_path / "run"
    gpus = min(torch.cuda.device_count(), 2)  # two where there are: DeepSpeed broadcasts the packed base weights
    args = ["run", "--preset", "stage2", "--accelerator", "cuda", "--gpus", str(gpus), "--run-dir", str(run_dir)]
    for item in (f"model.name=hf:{model_dir}", "model.lora={r: 8, target_modules: all-linear, quantize: nf4}",
                 "data.tokenizer=byte", "data.seq_len=32", "train.micro_batch_size=4", "train.max_steps=6",
                 "train.lr=0.01", "train.warmup_steps=0", "train.log_every=1", "train.eval_batches=1",
                 "train.eval_every=1000", "train.export_final=peft", "train.precision=bf16"):
        args += ["--set", item]
    result = dstrain(*args)
    assert_ok(result)
    steps = losses(run_dir)
    assert sorted(steps) == [1, 2, 3, 4, 5, 6] and all(math.isfinite(v) for v in steps.values())
    assert sum(steps[s] for s in (4, 5, 6)) < sum(steps[s] for s in (1, 2, 3))  # the adapters learn

    checkpoint = open_checkpoint(run_dir / rundir.CHECKPOINTS, None)
    optimized = [name for group in checkpoint.states["param_shapes"] for name in group]
    assert optimized and all(".lora_A." in n or ".lora_B." in n for n in optimized)
    saved = checkpoint.states["module"]  # the frozen base as it trained: packed 4-bit weights and their scales
    base_weight = "model.base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    assert saved[base_weight].dtype == torch.uint8 and saved[base_weight].numel() == 32 * 32 // 2
    assert f"{base_weight}.absmax" in saved

    adapter = run_dir / "final_adapter"
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base, str(adapter)).eval()
    inputs = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        assert not torch.allclose(adapted(input_ids=inputs).logits, reference(input_ids=inputs).logits)

    merged = dstrain("convert-checkpoint", str(run_dir / rundir.CHECKPOINTS), str(tmp_path / "merged"), "--format", "hf")
    assert merged.returncode == 2 and "--format peft" in merged.stderr and not (tmp_path / "merged").exists()

    generated = dstrain("generate", str(run_dir), "--prompt", "The capital of France is", "--max-new-tokens", "8")
    assert_ok(generated)
    assert generated.stdout.strip()
