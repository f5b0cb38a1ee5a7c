"""train.precision=fp8 (dstrain/config/fp8.py, dstrain/models/fp8.py): the refusals, the DeepSpeed config it
renders, which linear layers convert, and that the conversion keeps checkpoints and ZeRO-3 as in bf16.

The conversion tests run torchao's float8 training in its emulation mode (FP8-rounded operands multiplied in
bf16), which runs on CPU: everything around the matmul is the GPU path's. The FP8 kernels themselves and the
speed are measured by benchmarks/fp8.py on GPUs."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from typer.testing import CliRunner

from dstrain.cli import app
from dstrain.config.layers import ENV_DEEPSPEED_CONFIG
from dstrain.config.resolve import resolve
from dstrain.models import fp8
from dstrain.models.gpt import GPT



def _config_error(*args: str) -> str:
    result = CliRunner().invoke(app, ["config", *args], env={ENV_DEEPSPEED_CONFIG: None})
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output
    return result.stderr


# --------------------------------------------------------------------------- config

def test_fp8_is_refused_on_cpu_ranks_naming_the_key_and_the_fix():
    message = _config_error("--accelerator", "cpu", "--set", "train.precision=fp8")
    assert "--set: train.precision" in message
    assert "cpu ranks" in message and "compute capability 8.9" in message
    assert "fix: set train.precision=bf16 (or fp32) for cpu ranks" in message


def test_fp8_refuses_lora_autocast_and_your_own_model_all_at_once():
    message = _config_error("--accelerator", "cuda", "--set", "train.precision=fp8", "--set",
                            "model.name=my_package.models:build", "--set", "train.mixed_precision=autocast")
    assert "2 problems" in message, message
    assert "your own model" in message and "convert_to_float8_training" in message
    assert "train.mixed_precision=autocast" in message
    lora = _config_error("--accelerator", "cuda", "--set", "train.precision=fp8", "--set",
                         "model.name=hf:meta-llama/Llama-3.2-1B", "--set", "model.lora={r: 16}")
    assert "FP8 with LoRA is not supported" in lora


def test_fp8_trains_bf16_weights_through_deepspeeds_bf16_section():
    for preset in ("stage1", "stage2", "stage3"):
        resolved = resolve(preset=preset, sets=["train.precision=fp8"], accelerator="cuda", env={})
        assert resolved.precision == "fp8"
        assert resolved.ds_config["bf16"]["enabled"] is True
        assert "fp16" not in resolved.ds_config
        # compiled wherever it can be: torchao's casts are fused only in a compiled graph
        assert resolved.config.train.compile is True, (preset, resolved.sources["train.compile"])
    assert resolve(sets=["train.precision=fp8"], accelerator="cuda", env={}).config.train.fp8_recipe == "tensorwise"


def test_fp8_beside_deepspeeds_own_bf16_section_is_no_conflict(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"bf16": {"enabled": true}}')
    resolved = resolve(sets=["train.precision=fp8"], accelerator="cuda", env={ENV_DEEPSPEED_CONFIG: str(path)})
    assert resolved.precision == "fp8" and resolved.ds_config["bf16"]["enabled"] is True


def test_a_missing_torchao_is_named_with_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    problems = fp8.runtime_problems("train.precision")
    assert any("torchao is not installed" in p.message and "pip install 'dstrain[fp8]'" in p.fix for p in problems)


# --------------------------------------------------------------------------- which layers convert

def _gpt(n_layer: int = 4, d_model: int = 64) -> GPT:
    return GPT(vocab_size=96, seq_len=16, d_model=d_model, n_layer=n_layer, n_head=4)


def test_the_gpt_converts_its_middle_blocks_and_keeps_the_ends_and_head():
    chosen, kept = fp8.fp8_layers(_gpt())
    assert chosen == {f"blocks.{i}.{name}" for i in (1, 2) for name in ("attn.qkv", "attn.proj", "mlp.0", "mlp.2")}
    assert kept["head"].startswith("outside the decoder layers")
    assert {name for name, why in kept.items() if "first or the last" in why} == {
        f"blocks.{i}.{name}" for i in (0, 3) for name in ("attn.qkv", "attn.proj", "mlp.0", "mlp.2")}


def test_a_dimension_not_divisible_by_16_and_a_frozen_layer_stay_bf16():
    model = _gpt(d_model=40)  # 40, 120, 160: 40 is not a multiple of 16
    chosen, kept = fp8.fp8_layers(model)
    assert not chosen and "blocks.1.mlp.0" in kept and "not divisible by 16" in kept["blocks.1.mlp.0"]
    model = _gpt()
    model.blocks[1].mlp[0].weight.requires_grad_(False)
    chosen, kept = fp8.fp8_layers(model)
    assert kept["blocks.1.mlp.0"] == "frozen" and "blocks.2.mlp.0" in chosen


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_an_hf_model_converts_its_middle_decoder_layers(family):
    transformers = pytest.importorskip("transformers")
    from dstrain.models.hf import CausalLM
    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64)
    if family == "llama":
        config = transformers.LlamaConfig(intermediate_size=128, **common)
    else:  # Qwen2's MLP of 72 is not a multiple of 16: its three projections stay bf16
        config = transformers.Qwen2Config(intermediate_size=72, tie_word_embeddings=True, **common)
    model = CausalLM(transformers.AutoModelForCausalLM.from_config(config))
    chosen, kept = fp8.fp8_layers(model)
    attention = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"}
    mlp = {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    inside = attention | (mlp if family == "llama" else set())
    assert chosen == {f"model.model.layers.{i}.{name}" for i in (1, 2) for name in inside}
    assert "model.lm_head" in kept and "model.model.layers.0.mlp.down_proj" in kept
    if family == "qwen2":
        assert "not divisible by 16" in kept["model.model.layers.1.mlp.up_proj"]


# --------------------------------------------------------------------------- conversion (torchao)

def test_conversion_keeps_the_state_dict_so_checkpoints_load_in_bf16():
    from torchao.float8.float8_linear import Float8Linear
    torch.manual_seed(0)
    model = _gpt().to(torch.bfloat16)
    keys = {k: v.shape for k, v in model.state_dict().items()}
    line = fp8.convert_to_fp8(model, "tensorwise", emulate=True)
    assert line.startswith("fp8: 8 of 17 linear layers multiply in FP8 (torchao tensorwise)"), line
    assert isinstance(model.blocks[1].mlp[0], Float8Linear) and not isinstance(model.blocks[0].mlp[0], Float8Linear)
    assert type(model.head) is torch.nn.Linear and model.head.weight is model.tok_emb.weight  # still tied
    state = model.state_dict()
    assert {k: v.shape for k, v in state.items()} == keys
    plain = _gpt().to(torch.bfloat16)
    plain.load_state_dict(state, strict=True)
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), state.values()))


def test_full_precision_accumulation_reaches_every_converted_layers_forward_matmul():
    """train.fp8_fast_accum false: the forward matmul (torchao's recipes: fast accumulation) accumulates in
    full precision; the backward matmuls never use fast accumulation."""
    from torchao.float8.float8_linear import Float8Linear
    assert resolve(sets=["train.precision=fp8"], accelerator="cuda", env={}).config.train.fp8_fast_accum is True
    for fast in (True, False):
        model = _gpt().to(torch.bfloat16)
        line = fp8.convert_to_fp8(model, "tensorwise", emulate=True, fast_accum=fast)
        converted = [m for m in model.modules() if isinstance(m, Float8Linear)]
        assert converted and {m.config.gemm_config_output.use_fast_accum for m in converted} == {fast}
        assert {m.config.gemm_config_grad_weight.use_fast_accum for m in converted} == {False}
        assert ("full-precision accumulation" in line) is not fast, line


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_converted_model_trains_close_to_bf16(recipe):
    torch.manual_seed(0)
    model = _gpt().to(torch.bfloat16)
    reference = _gpt().to(torch.bfloat16)
    reference.load_state_dict(model.state_dict())
    fp8.convert_to_fp8(model, recipe, emulate=True)
    batch = (torch.randint(0, 96, (4, 16)), torch.randint(0, 96, (4, 16)))
    loss, ref = model(batch), reference(batch)
    loss.backward()
    ref.backward()
    assert loss.item() != ref.item()  # the middle blocks' matmuls did change
    assert abs(loss.item() - ref.item()) / ref.item() < 0.01
    grad, ref_grad = model.blocks[1].mlp[0].weight.grad.float(), reference.blocks[1].mlp[0].weight.grad.float()
    assert torch.nn.functional.cosine_similarity(grad.flatten(), ref_grad.flatten(), dim=0) > 0.98


ZERO_STAGES = """
import dstrain.models.fp8 as fp8
from dstrain.models.gpt import GPT
EMULATE, WIDTH = {emulate}, {width}

def run(stage, precision):
    torch.manual_seed(0)
    ds = {{"train_micro_batch_size_per_gpu": 2, "bf16": {{"enabled": True}}, "zero_optimization": {{"stage": stage}},
          "zero_allow_untested_optimizer": True, "gradient_clipping": 1.0}}
    build = lambda: GPT(vocab_size=96, seq_len=16, d_model=WIDTH, n_layer=4, n_head=4)
    model = build()
    if stage == 3:  # partitioned as it is built (as dstrain builds at ZeRO-3), then given the same weights
        start = model
        with deepspeed.zero.Init(config_dict_or_path=ds):
            model = build()
        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
            for mine, theirs in zip(model.parameters(), start.parameters()):
                mine.data.copy_(theirs.data)
    line = fp8.convert_to_fp8(model, "tensorwise", emulate=EMULATE) if precision == "fp8" else ""
    engine, *_ = deepspeed.initialize(model=model, config=ds,
                                      optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
    data = torch.Generator().manual_seed(1)
    batch = tuple(torch.randint(0, 96, (2, 16), generator=data).to(engine.device) for _ in range(2))
    losses = []
    for _ in range(4):  # one batch again and again: its loss falls
        loss = engine(batch)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    kinds = sorted({{type(m).__name__ for m in engine.module.modules() if isinstance(m, torch.nn.Linear)}})
    return {{"losses": losses, "kinds": kinds, "line": line}}

runs = {{f"{{stage}}-{{precision}}": run(stage, precision) for stage, precision in {runs}}}
"""


HF_ZERO3 = """
import transformers
import dstrain.models.fp8 as fp8
from dstrain.models.hf import CausalLM
shape = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)

def run_hf(stage, leaf):
    torch.manual_seed(0)
    ds = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "zero_optimization": {"stage": stage},
          "zero_allow_untested_optimizer": True, "gradient_clipping": 1.0}
    if leaf:  # what dstrain renders where it keeps each decoder layer whole: one fetch a layer
        ds["zero_optimization"]["leaf_module"] = {"classes": ["LlamaDecoderLayer"]}
    model = start = CausalLM(transformers.AutoModelForCausalLM.from_config(shape))
    if stage == 3:
        with deepspeed.zero.Init(config_dict_or_path=ds):
            model = CausalLM(transformers.AutoModelForCausalLM.from_config(shape))
        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
            for mine, theirs in zip(model.parameters(), start.parameters()):
                mine.data.copy_(theirs.data)
    fp8.convert_to_fp8(model, "tensorwise", emulate=True)
    engine, *_ = deepspeed.initialize(model=model, config=ds, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
    data = torch.Generator().manual_seed(1)
    batch = tuple(torch.randint(0, 128, (2, 16), generator=data) for _ in range(2))
    losses = []
    for _ in range(4):
        loss = engine(batch)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses

hf_runs = {name: run_hf(stage, leaf) for name, stage, leaf in (("zero1", 1, False), ("zero3", 3, False), ("leaf", 3, True))}
"""


@pytest.fixture(scope="module")
def emulated_runs():
    """One rank process for both: the GPT at ZeRO-1 and ZeRO-3, the Llama at ZeRO-1, ZeRO-3 and with leaf layers."""
    from one_rank import run_one_rank
    gpt = ZERO_STAGES.format(emulate=True, width=64, runs=[(1, "fp8"), (3, "fp8")])
    return run_one_rank(gpt + HF_ZERO3 + '\nresult({"gpt": runs, "hf": hf_runs})')


@pytest.mark.slow
def test_zero3_gathers_the_float8_layers_weights_as_zero1_trains_them(emulated_runs):
    """ZeRO-3 partitions each weight and gathers it in module hooks around Float8Linear's forward and
    backward: the same losses as ZeRO-1, which never partitions a weight, step after step."""
    runs = emulated_runs["gpt"]
    one, three = runs["1-fp8"], runs["3-fp8"]
    assert one["kinds"] == three["kinds"] == ["Float8Linear", "Linear"]
    assert three["line"] == one["line"]
    assert one["losses"][-1] < one["losses"][0]  # it trains
    assert three["losses"] == pytest.approx(one["losses"], rel=2e-3)


@pytest.mark.slow
def test_an_hf_models_float8_layers_train_at_zero3_with_and_without_whole_decoder_layers(emulated_runs):
    """A Llama built inside zero.Init (partitioned before conversion), at ZeRO-3 with DeepSpeed's per-module hooks
    and with each decoder layer one fetch (a leaf module): the same losses either way, and ZeRO-1's first loss.
    (Later steps drift apart as in bf16: this model's ZeRO-1 and ZeRO-3 differ in the last bits from the start.)"""
    runs = emulated_runs["hf"]
    assert runs["leaf"] == runs["zero3"]
    assert runs["zero3"][0] == pytest.approx(runs["zero1"][0], rel=1e-4)
    assert runs["zero3"][-1] < runs["zero3"][0]


def _fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= fp8.FP8_MIN_CAPABILITY


@pytest.mark.slow
@pytest.mark.skipif(not _fp8_gpu(), reason="needs a CUDA GPU of compute capability 8.9 or more")
def test_on_an_fp8_gpu_zero1_and_zero3_train_within_a_percent_of_bf16():
    """torch._scaled_mm for real: the FP8 losses within 1% of bf16's at ZeRO-1 and ZeRO-3."""
    from one_rank import run_one_rank
    runs = run_one_rank(ZERO_STAGES.format(emulate=False, width=256, runs=[(1, "bf16"), (1, "fp8"), (3, "fp8")])
                        + "\nresult(runs)", accelerator="cuda")
    assert runs["1-fp8"]["kinds"] == ["Float8Linear", "Linear"]
    for name in ("1-fp8", "3-fp8"):
        assert runs[name]["losses"] == pytest.approx(runs["1-bf16"]["losses"], rel=0.01), name
