"""Pretrained Hugging Face models (model.name "hf:..."), train.init_from, freezing, LoRA and the
`--format hf` export, without the launcher: tiny Llama and GPT-2 models saved with save_pretrained.

The launcher-level runs (2 CPU ranks, ZeRO 2 and 3) are in tests/test_hf_runs.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from hf_models import save_tiny_gpt2, save_tiny_llama, transformers_loss

from dstrain.cli import app
from dstrain.config.schema import RunConfig
from dstrain.errors import UserError
from dstrain.models import hf, setup
from dstrain.models.gpt import GPT
from dstrain.rundir import HF_LORA
from dstrain.tools.convert.hf_folder import folder_from_weights

transformers = pytest.importorskip("transformers")


def run_config(model_dir, **train) -> RunConfig:
    return RunConfig.model_validate({"model": {"name": f"hf:{model_dir}"},
                                     "data": {"seq_len": 16, "tokenizer": "byte"}, "train": train})


def stage(n: int) -> dict:
    return {"zero_optimization": {"stage": n}}


def batch(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    window = torch.randint(0, 256, (2, 17), generator=generator)
    return window[:, :-1], window[:, 1:]


def saved_weights(model_dir) -> dict[str, torch.Tensor]:
    return load_file(model_dir / "model.safetensors")


def logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=inputs).logits


# ------------------------------------------------------------------ loading


def test_stage2_build_holds_the_saved_weights(llama_dir):
    model = hf.build_pretrained(run_config(llama_dir), stage(2), torch.device("cpu"))
    state = model.model.state_dict()
    for name, value in saved_weights(llama_dir).items():
        assert torch.equal(state[name], value), name


def test_loss_equals_the_loss_transformers_computes(llama_dir):
    model = hf.build_pretrained(run_config(llama_dir), stage(0), torch.device("cpu"))
    inputs, targets = batch()
    with torch.no_grad():
        ours = model((inputs, targets)).item()
    assert ours == pytest.approx(transformers_loss(llama_dir, inputs, targets), rel=1e-6)


def test_targets_of_minus_100_take_no_loss(llama_dir):
    model = hf.build_pretrained(run_config(llama_dir), stage(0), torch.device("cpu"))
    inputs, targets = batch()
    masked = targets.clone()
    masked[:, :8] = -100
    with torch.no_grad():
        full_logits = model.model(input_ids=inputs).logits
        expected = torch.nn.functional.cross_entropy(full_logits[:, 8:].flatten(0, 1), targets[:, 8:].flatten())
        assert model((inputs, masked)).item() == pytest.approx(expected.item(), rel=1e-6)


def test_dtype_kwarg_builds_in_that_dtype(llama_dir):
    config = RunConfig.model_validate({"model": {"name": f"hf:{llama_dir}", "kwargs": {"dtype": "bfloat16"}}})
    model = hf.build_pretrained(config, stage(1), torch.device("cpu"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_meta_count_equals_the_real_model(llama_dir):
    from dstrain.models import check_model
    params = check_model(run_config(llama_dir)).params
    real = transformers.AutoModelForCausalLM.from_pretrained(llama_dir)
    assert params == sum(p.numel() for p in real.parameters())


def test_flops_count_the_output_head_but_not_the_embedding_lookup(llama_dir):
    from dstrain.models import flops_per_token
    config = run_config(llama_dir)
    model = hf.build_pretrained(config, stage(0), torch.device("cpu"))
    n = sum(p.numel() for p in model.parameters())
    lookup = model.model.get_input_embeddings().weight.numel()
    assert flops_per_token(model, config, n) == 6.0 * (n - lookup) + 12.0 * 2 * 32 * config.data.seq_len


def test_weights_that_do_not_fit_the_config_name_the_keys(llama_dir, tmp_path):
    from dstrain.models.weights import load_into, plain_route, raise_if_incomplete
    weights = saved_weights(llama_dir)
    weights["model.extra.weight"] = torch.zeros(3)
    del weights["model.norm.weight"]
    save_file(weights, tmp_path / "bad.safetensors")
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir)
    report = load_into(model, [tmp_path / "bad.safetensors"], plain_route(lambda k, names: k if k in names else None),
                       zero3=False)
    assert report.missing == ["model.norm.weight"]
    assert report.unexpected == ["model.extra.weight"]
    with pytest.raises(UserError, match="model.norm.weight"):
        raise_if_incomplete(report, "here", "fix")


# The ZeRO-3 loader and the hf export on other families (Qwen2's biases, Gemma's tied head, GPT-NeoX's
# embed_out) and on mixtures of experts: tests/test_moe.py, one two-rank run for all of them.


# ------------------------------------------------------------------ init_from and freezing


def tiny_gpt() -> GPT:
    return GPT(vocab_size=64, seq_len=16, d_model=32, n_layer=2, n_head=2)


def gpt_config(**train) -> RunConfig:
    return RunConfig.model_validate({"model": {"n_layer": 2, "n_head": 2, "d_model": 32, "vocab_size": 64},
                                     "data": {"seq_len": 16}, "train": train})


def test_init_from_loads_every_weight_of_a_consolidated_file(tmp_path):
    torch.manual_seed(1)
    source = tiny_gpt()
    save_file({k: v.clone() for k, v in source.state_dict().items()}, tmp_path / "w.safetensors")
    torch.manual_seed(2)
    target = tiny_gpt()
    setup.load_init_from(gpt_config(init_from=str(tmp_path / "w.safetensors")), target, zero3=False)
    for name, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], value), name


def test_init_from_with_foreign_keys_names_missing_and_unexpected(tmp_path):
    state = {k: v.clone() for k, v in tiny_gpt().state_dict().items()}
    state["blocks.9.extra"] = state.pop("ln_f.weight")
    save_file(state, tmp_path / "w.safetensors")
    with pytest.raises(UserError) as err:
        setup.check_init_keys(gpt_config(init_from=str(tmp_path / "w.safetensors")), tiny_gpt())
    assert "ln_f.weight" in str(err.value) and "blocks.9.extra" in str(err.value)
    assert "train.init_from" in str(err.value)


def test_trainable_patterns_leave_only_matching_parameters_to_train():
    model = tiny_gpt()
    setup.apply_freezing(gpt_config(trainable=["blocks.1.*"], frozen=["*.ln1.*"]), model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith("blocks.1.") and ".ln1." not in n for n in trainable)
    assert "blocks.1.attn.qkv.weight" in trainable


def test_hf_patterns_match_the_models_own_names(llama_dir):
    model = hf.build_pretrained(run_config(llama_dir), stage(0), torch.device("cpu"))
    setup.apply_freezing(run_config(llama_dir, frozen=["model.embed_tokens.*", "lm_head.*"]), model)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {"model.model.embed_tokens.weight", "model.lm_head.weight"}


# ------------------------------------------------------------------ LoRA


def test_lora_trains_only_the_adapters(gpt2_dir):
    config = RunConfig.model_validate({"model": {"name": f"hf:{gpt2_dir}", "lora": {"r": 4}}})
    model = hf.build_pretrained(config, stage(2), torch.device("cpu"))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)


def test_lora_without_peft_says_what_to_install(gpt2_dir, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "peft", None)  # as if not installed: importing it raises ImportError
    config = RunConfig.model_validate({"model": {"name": f"hf:{gpt2_dir}", "lora": {"r": 4}}})
    with pytest.raises(UserError) as err:
        hf.skeleton_builder(config)()
    assert "model.lora: peft is not installed" in str(err.value) and "pip install 'dstrain[hf]'" in str(err.value)


def test_lora_starts_from_the_base_models_loss(gpt2_dir):
    config = RunConfig.model_validate({"model": {"name": f"hf:{gpt2_dir}", "lora": {"r": 4}}})
    model = hf.build_pretrained(config, stage(2), torch.device("cpu"))
    inputs, targets = batch()
    with torch.no_grad():
        assert model((inputs, targets)).item() == pytest.approx(transformers_loss(gpt2_dir, inputs, targets),
                                                                rel=1e-6)


# ------------------------------------------------------------------ export


def source_dir_for(model_dir, tmp_path, lora_layers=None):
    """What `dstrain run` copies into <run_dir>/hf_source."""
    source = tmp_path / "hf_source"
    source.mkdir()
    for name in ("config.json", "generation_config.json"):
        (source / name).write_bytes((model_dir / name).read_bytes())
    if lora_layers is not None:
        (source / HF_LORA).write_text(json.dumps(lora_layers))
    return source


def consolidated(model, path):
    """What `convert-checkpoint` writes for a dstrain model: its state_dict, wrapper prefix included."""
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    save_file(state, path)
    return path


def test_export_loads_in_transformers_with_equal_logits(llama_dir, tmp_path):
    model = hf.build_pretrained(run_config(llama_dir), stage(0), torch.device("cpu"))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))  # "trained": differs from the saved model
    weights = consolidated(model, tmp_path / "w.safetensors")
    out = tmp_path / "out"
    folder_from_weights(weights, source_dir_for(llama_dir, tmp_path), out, max_shard_size="40KB")
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("model-*.safetensors"))) > 1
    inputs, _ = batch()
    torch.testing.assert_close(logits(loaded, inputs), logits(model.model, inputs), rtol=0, atol=1e-6)


def test_export_drops_the_tied_copy_as_save_pretrained_does(gpt2_dir, tmp_path):
    model = hf.build_pretrained(run_config(gpt2_dir), stage(0), torch.device("cpu"))
    weights = consolidated(model, tmp_path / "w.safetensors")
    assert "model.lm_head.weight" in load_file(weights)
    folder_from_weights(weights, source_dir_for(gpt2_dir, tmp_path), tmp_path / "out")
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert set(exported) == set(saved_weights(gpt2_dir))


def test_export_in_bf16_writes_bf16_and_says_so_in_config(llama_dir, tmp_path):
    model = hf.build_pretrained(run_config(llama_dir), stage(0), torch.device("cpu"))
    weights = consolidated(model, tmp_path / "w.safetensors")
    folder_from_weights(weights, source_dir_for(llama_dir, tmp_path), tmp_path / "out", dtype="bf16")
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert {v.dtype for v in exported.values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    for name, value in saved_weights(llama_dir).items():
        assert torch.equal(exported[name], value.to(torch.bfloat16)), name


def test_export_merges_lora_as_peft_does(gpt2_dir, tmp_path):
    config = RunConfig.model_validate({"model": {"name": f"hf:{gpt2_dir}", "lora": {"r": 4, "alpha": 8}}})
    model = hf.build_pretrained(config, stage(0), torch.device("cpu"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)  # a trained adapter: B is no longer zero
    weights = consolidated(model, tmp_path / "w.safetensors")
    folder_from_weights(weights, source_dir_for(gpt2_dir, tmp_path, hf.lora_layers(model)), tmp_path / "out")
    merged = model.model.merge_and_unload()  # peft's own merge
    exported = load_file(tmp_path / "out" / "model.safetensors")
    for name, value in merged.state_dict().items():
        if name != "lm_head.weight":  # the tied copy
            torch.testing.assert_close(exported[name], value, rtol=0, atol=1e-6, msg=name)
    assert not torch.allclose(exported["transformer.h.0.attn.c_attn.weight"],
                              saved_weights(gpt2_dir)["transformer.h.0.attn.c_attn.weight"])


def test_export_refuses_an_existing_folder_and_leaves_it(llama_dir, tmp_path):
    model = hf.build_pretrained(run_config(llama_dir), stage(0), torch.device("cpu"))
    weights = consolidated(model, tmp_path / "w.safetensors")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep")
    with pytest.raises(UserError, match="already exists"):
        folder_from_weights(weights, source_dir_for(llama_dir, tmp_path), tmp_path / "out")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["mine.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf_source", "out", "w.safetensors"]


def test_convert_format_hf_without_an_hf_run_explains(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    result = CliRunner().invoke(app, ["convert-checkpoint", str(tmp_path / "checkpoints"), str(tmp_path / "out"),
                                      "--format", "hf"])
    assert result.exit_code == 2
    assert "--hf-source" in " ".join(result.output.split())
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ bad input at --dry-run


def dry_run(tmp_path, monkeypatch, *sets: str):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    args = ["run", "--preset", "stage3", "--dry-run", "--accelerator", "cpu", "--gpus", "2",
            "--set", "data.seq_len=16", "--set", "train.micro_batch_size=2",
            "--set", "data.tokenizer=byte"]  # the tiny models are saved without a tokenizer
    for item in sets:
        args += ["--set", item]
    result = CliRunner().invoke(app, args)
    output = " ".join(result.output.split())
    assert "Traceback" not in output
    assert not (tmp_path / "runs").exists()
    return result.exit_code, output


def test_dry_run_rejects_a_directory_without_config_json(tmp_path, monkeypatch):
    (tmp_path / "empty_model").mkdir()
    code, output = dry_run(tmp_path, monkeypatch, f"model.name=hf:{tmp_path / 'empty_model'}")
    assert code == 2 and "has no config.json" in output and "save_pretrained" in output


def test_dry_run_rejects_a_model_folder_without_weights(llama_dir, tmp_path, monkeypatch):
    (tmp_path / "no_weights").mkdir()
    (tmp_path / "no_weights" / "config.json").write_bytes((llama_dir / "config.json").read_bytes())
    code, output = dry_run(tmp_path, monkeypatch, f"model.name=hf:{tmp_path / 'no_weights'}")
    assert code == 2 and "no weights in" in output and "save_pretrained" in output


def test_dry_run_rejects_an_architecture_transformers_does_not_know(tmp_path, monkeypatch):
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text(json.dumps({"model_type": "no-such-arch", "vocab_size": 256}))
    code, output = dry_run(tmp_path, monkeypatch, f"model.name=hf:{tmp_path / 'odd'}")
    assert code == 2 and "config.json: model_type" in output and "trust_remote_code" in output


def test_dry_run_rejects_a_tokenizer_larger_than_the_embedding(tmp_path, monkeypatch):
    small = save_tiny_llama(tmp_path / "small", vocab_size=128)
    code, output = dry_run(tmp_path, monkeypatch, f"model.name=hf:{small}")
    assert code == 2 and "data.tokenizer: byte" in output and "256 tokens" in output and "only 128" in output


def test_dry_run_rejects_a_lora_target_that_matches_nothing(llama_dir, tmp_path, monkeypatch):
    code, output = dry_run(tmp_path, monkeypatch, f"model.name=hf:{llama_dir}",
                           "model.lora={r: 4, target_modules: [attention_dense]}")
    assert code == 2 and "model.lora.target_modules" in output and "q_proj" in output


def test_dry_run_rejects_a_freezing_pattern_that_matches_nothing(llama_dir, tmp_path, monkeypatch):
    code, output = dry_run(tmp_path, monkeypatch, f"model.name=hf:{llama_dir}", "train.frozen=[encoder.*]")
    assert code == 2 and "train.frozen[0]" in output and "'encoder.*' matches no parameter" in output


def test_dry_run_accepts_a_saved_model_and_counts_it(llama_dir, tmp_path, monkeypatch):
    code, output = dry_run(tmp_path, monkeypatch, f"model.name=hf:{llama_dir}")
    real = transformers.AutoModelForCausalLM.from_pretrained(llama_dir)
    assert code == 0, output
    assert f"{sum(p.numel() for p in real.parameters()):,} parameters" in output


def test_export_final_hf_needs_an_hf_model():
    from dstrain.config.resolve import resolve
    with pytest.raises(UserError, match="train.export_final: export_final: hf writes a Hugging Face folder"):
        resolve("stage2", None, ["train.export_final=hf"], world_size=2, accelerator="cpu")


def test_lora_needs_an_hf_model():
    with pytest.raises(ValueError, match="model.lora needs an"):
        RunConfig.model_validate({"model": {"name": "gpt", "lora": {"r": 4}}})


def test_dry_run_names_a_model_folder_without_a_tokenizer_when_the_data_needs_one(llama_dir, tmp_path, monkeypatch):
    code, output = dry_run(tmp_path, monkeypatch, f"model.name=hf:{llama_dir}", "data.tokenizer=null")
    assert code == 2 and "holds no tokenizer files" in output and "data.tokenizer" in output


@pytest.mark.parametrize("preset, sets, leaf", [
    ("stage3", [], True),
    ("stage2", [], False),  # nothing is fetched below stage 3
    ("stage3", ["deepspeed.zero_optimization.stage3_module_granularity_threshold=100"], False),  # the user chose
])
def test_zero3_fetches_each_transformer_block_of_an_hf_model_whole(llama_dir, monkeypatch, preset, sets, leaf):
    from dstrain.config.resolve import resolve
    from dstrain.launcher.preflight import check_runtime
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    resolved = resolve(preset, None, [f"model.name=hf:{llama_dir}", "data.tokenizer=byte", "data.seq_len=16", *sets],
                       world_size=2, accelerator="cpu", env={})
    check_runtime(resolved)
    classes = (resolved.ds_config["zero_optimization"].get("leaf_module") or {}).get("classes", [])
    assert ("transformers.models.llama.modeling_llama.LlamaDecoderLayer" in classes) is leaf
    if leaf:
        assert "MixtralSparseMoeBlock" in " ".join(classes)  # DeepSpeed's own defaults stay
        assert "LlamaDecoderLayer" in resolved.sources["deepspeed.zero_optimization.leaf_module"]


@pytest.mark.parametrize("world, sets, whole", [
    (1, [], True),
    (2, [], True),  # a tiny model: under the size up to which several GPUs keep layers whole
    (1, ["deepspeed.zero_optimization.stage3_param_persistence_threshold=5000"], False),  # the user chose
    (1, ["deepspeed.zero_optimization.offload_optimizer.device=cpu"], False),  # offload: not measured
])
def test_zero3_on_gpus_keeps_each_decoder_layer_of_an_hf_model_whole(tmp_path, world, sets, whole):
    import transformers

    from dstrain.config.resolve import resolve
    from dstrain.launcher.preflight import check_runtime
    llama_dir = save_tiny_llama(tmp_path / "llama", intermediate_size=4096)  # a weight above DeepSpeed's 100,000
    resolved = resolve("stage3", None, [f"model.name=hf:{llama_dir}", "data.tokenizer=byte", "data.seq_len=16", *sets],
                       world_size=world, accelerator="cuda", env={})
    check_runtime(resolved)
    zero = resolved.ds_config["zero_optimization"]
    largest = max(p.numel() for p in transformers.AutoModelForCausalLM.from_pretrained(llama_dir).model.layers[0].parameters())
    assert (zero["stage3_param_persistence_threshold"] == largest) is whole
    assert (zero.get("memory_efficient_linear") is False) is whole
    source = resolved.sources["deepspeed.zero_optimization.stage3_param_persistence_threshold"]
    assert ("each decoder layer stays whole" in source) is whole
    # train.compile "auto" follows the layers: compiled whole (measured faster), eager sharded (measured no faster);
    # with offload it is off before the model is checked ("not measured")
    assert resolved.config.train.compile is whole
    why = resolved.sources["train.compile"]
    assert ("each decoder layer kept whole" in why) is whole
    assert "decided when the model is checked" not in why
    if not whole:
        assert "sharded" in why or "not measured" in why


def test_the_named_chat_template_a_run_trains_in_goes_with_its_exports_so_generate_chats_in_it(tmp_path):
    from dstrain.data.templates import TEMPLATES
    model_dir = save_tiny_llama(tmp_path / "llama")
    config = RunConfig.model_validate({"model": {"name": f"hf:{model_dir}"},
                                       "data": {"source": "jsonl", "format": "sharegpt", "chat_template": "chatml"}})
    hf.save_source(config, tmp_path / "run")
    assert (tmp_path / "run" / "hf_source" / "chat_template.jinja").read_text() == TEMPLATES["chatml"]
    plain = config.model_copy(update={"data": config.data.model_copy(update={"format": "prompt_response"})})
    hf.save_source(plain, tmp_path / "run-plain")  # a format that renders no conversation trains in no template
    assert not (tmp_path / "run-plain" / "hf_source" / "chat_template.jinja").exists()
