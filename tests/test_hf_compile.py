"""Regional compilation of hf: models (rank/runtime.py compile_hf_blocks): each decoder layer compiled on
its own, the rest eager, at every ZeRO stage; and when train.compile "auto" turns it on.

Fast lane: the config decisions, which blocks are compiled, and that a Llama and a Qwen2 layer trace as one
graph with no breaks (dynamo only, no code generation). Launcher lane (integration): inductor's compiled
blocks against eager, loss and gradients, on CPU (its C++ compile takes 10-30 s on 2 cores), and a 2-rank
ZeRO-3 run compiled against the same run eager.
"""

from __future__ import annotations

import pytest
import torch

from launcher import assert_ok, losses, run_hf

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)


def tiny(family: str):
    """A tiny Llama or Qwen2 (tied embeddings; Qwen2's attention has biases and rope_theta 1e6), in fp32."""
    from dstrain.models.hf import CausalLM
    torch.manual_seed(0)
    config = (transformers.LlamaConfig(**SHAPE) if family == "llama"
              else transformers.Qwen2Config(**SHAPE, rope_theta=1e6))
    return CausalLM(transformers.AutoModelForCausalLM.from_config(config))


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (2, 17), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


class _Engine:
    """What compile_engine reads of a DeepSpeed engine: the module, and engine.compile() if it were called."""

    def __init__(self, module):
        self.module, self.global_steps, self.compiled = module, 0, False

    def compile(self, schedule=None):
        self.compiled = True


# ------------------------------------------------------------------------------------------ fast lane

@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_decoder_layer_traces_as_one_graph_without_breaks(family):
    """The attention interface dispatch, the rotary (cos, sin) tuple, the None cache and mask: all traced."""
    import torch._dynamo as dynamo
    model = tiny(family)
    layer = model.model.model.layers[0]
    seen = {}
    handle = layer.register_forward_pre_hook(lambda _m, args, kwargs: seen.setdefault("call", (args, kwargs)),
                                             with_kwargs=True)
    model(batch())
    handle.remove()
    args, kwargs = seen["call"]
    dynamo.reset()
    explained = dynamo.explain(layer.forward)(*args, **kwargs)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


@pytest.mark.parametrize("stage", [0, 2])
def test_every_decoder_layer_is_compiled_and_nothing_else(stage):
    from dstrain.rank.runtime import compile_engine
    model = tiny("qwen2")
    engine = _Engine(model)
    line = compile_engine(engine, {"zero_optimization": {"stage": stage}}, 1)
    compiled = [name for name, m in model.named_modules() if "forward" in vars(m)]
    assert compiled == [f"model.model.layers.{i}" for i in range(3)]
    assert not engine.compiled  # not engine.compile() of the whole model
    assert line.startswith("compile: 3 Qwen2DecoderLayer blocks compiled one by one")


def test_zero3_compiles_the_layers_that_are_leaf_modules():
    from deepspeed.utils import set_z3_leaf_modules

    from dstrain.rank.runtime import compile_engine
    model = tiny("llama")
    set_z3_leaf_modules(model, [type(model.model.model.layers[0])])
    line = compile_engine(_Engine(model), {"zero_optimization": {"stage": 3}}, 1)
    assert all("forward" in vars(layer) for layer in model.model.model.layers)
    assert "3 LlamaDecoderLayer blocks" in line


def test_zero3_without_leaf_layers_stays_eager_and_says_why():
    """LoRA at ZeRO-3 (a frozen base): DeepSpeed hooks each linear, and those hooks would be in the graph."""
    from dstrain.rank.runtime import compile_engine
    model = tiny("llama")
    engine = _Engine(model)
    line = compile_engine(engine, {"zero_optimization": {"stage": 3}}, 1)
    assert not any("forward" in vars(m) for m in model.modules()) and not engine.compiled
    assert line.startswith("compile: left eager") and "leaf module" in line


def test_a_lora_wrapped_models_layers_are_found_and_trace_as_one_graph():
    pytest.importorskip("peft")
    from dstrain.config.schema import LoraConfig
    from dstrain.models.hf import CausalLM, apply_lora, decoder_blocks
    import torch._dynamo as dynamo
    base = tiny("llama")
    model = CausalLM(apply_lora(base.model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])))
    blocks = decoder_blocks(model)
    assert len(blocks) == 3
    seen = {}
    handle = blocks[0].register_forward_pre_hook(lambda _m, args, kwargs: seen.setdefault("call", (args, kwargs)),
                                                 with_kwargs=True)
    model(batch())
    handle.remove()
    dynamo.reset()
    explained = dynamo.explain(blocks[0].forward)(*seen["call"][0], **seen["call"][1])
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def _resolved(preset: str, *sets: str, accelerator: str = "cuda"):
    from dstrain.config.resolve import resolve
    return resolve(preset, None, [*sets], world_size=1, accelerator=accelerator, env={})


@pytest.mark.parametrize("preset, sets", [("stage1", []), ("stage2", []),
                                         # measured with checkpointing: 1.15x eager in bf16, 2.36x in fp8
                                         ("stage2", ["train.activation_checkpointing=true"])])
def test_auto_compiles_an_hf_model_on_cuda_at_zero_1_and_2_and_explains_it(preset, sets, llama_dir):
    resolved = _resolved(preset, f"model.name=hf:{llama_dir}", *sets)
    assert resolved.config.train.compile is True
    assert "each decoder layer compiled on its own" in resolved.sources["train.compile"]
    assert not any("train.compile" in w for w in resolved.warnings)


@pytest.mark.parametrize("preset, sets, why", [
    ("stage3", ["model.lora.r=4"], "LoRA at ZeRO stage 3"),
    # before the model is checked: launcher/preflight.py decides it (tests/test_hf.py, layers kept whole)
    ("stage3", [], "on only where each decoder layer stays whole, decided when the model is checked"),
    ("stage2_offload", [], "offload_optimizer was not measured"),
    ("stage2", [], "not on cpu"),
    # the built-in GPT with DeepSpeed's activation checkpointing was not measured compiled
    ("stage2", ["model.name=gpt", "train.activation_checkpointing=true"], "measured compiled only for hf: models"),
])
def test_auto_leaves_an_hf_model_eager_where_it_was_not_measured_and_says_why(preset, sets, why, llama_dir):
    accelerator = "cpu" if why == "not on cpu" else "cuda"
    model = [] if "model.name=gpt" in sets else [f"model.name=hf:{llama_dir}"]
    resolved = _resolved(preset, *model, *sets, accelerator=accelerator)
    assert resolved.config.train.compile is False
    assert why in resolved.sources["train.compile"]


def test_compile_true_with_lora_at_zero3_warns_that_it_stays_eager(llama_dir):
    resolved = _resolved("stage3", f"model.name=hf:{llama_dir}", "model.lora.r=4", "train.compile=true")
    assert any("LoRA at ZeRO stage 3" in w and "stays eager" in w for w in resolved.warnings)
    plain = _resolved("stage3", f"model.name=hf:{llama_dir}", "train.compile=true")
    assert not any("train.compile" in w for w in plain.warnings)  # hf: layers at ZeRO-3 are the design


def test_compile_false_keeps_an_hf_model_eager(llama_dir):
    resolved = _resolved("stage2", f"model.name=hf:{llama_dir}", "train.compile=false")
    assert resolved.config.train.compile is False


# ------------------------------------------------------------------------------------- launcher lane

@pytest.mark.integration
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_compiled_blocks_give_eagers_loss_and_gradients(family):
    """... and the three layers share one compiled graph (no compile per layer, no recompiles)."""
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    from dstrain.rank.runtime import compile_hf_blocks
    dynamo.reset()
    counters.clear()
    eager, compiled = tiny(family), tiny(family)
    assert compile_hf_blocks(compiled, 2).startswith("compile: 3 ")
    for step in range(2):  # the second step runs the cached graph
        inputs = batch(step)
        losses_ = []
        for model in (eager, compiled):
            model.zero_grad(set_to_none=True)
            loss = model(inputs)
            loss.backward()
            losses_.append(loss.detach())
        torch.testing.assert_close(losses_[1], losses_[0], rtol=1e-5, atol=1e-5)
        for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["recompiles"]


@pytest.mark.integration
def test_zero3_two_ranks_compiled_train_as_eager(tmp_path, zero3_llama_run):
    """The real launcher, 2 CPU ranks, ZeRO-3 with the layers as leaf modules: compiled, each rank says so,
    and the losses are the eager run's (test_hf_runs' ZeRO-3 Llama run, the same sets but train.compile)."""
    eager = zero3_llama_run
    assert_ok(eager.result)
    run_dir = tmp_path / "compiled"
    result = run_hf(run_dir, "stage3", eager.model_dir, *eager.sets, "train.compile=true")
    assert_ok(result)
    assert "compile: 2 LlamaDecoderLayer blocks compiled one by one" in result.stdout + result.stderr
    assert "compiled one by one" not in eager.result.stdout + eager.result.stderr
    compiled, eager_losses = losses(run_dir), losses(eager.run_dir)
    assert sorted(compiled) == sorted(eager_losses) == [1, 2, 3]
    for step in eager_losses:
        assert compiled[step] == pytest.approx(eager_losses[step], rel=1e-4)
