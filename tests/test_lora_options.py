"""LoRA options (model.lora): the one table of them, what reaches peft, the checks before launch, the
merged export of DoRA and modules_to_save, the adapter names peft saves, and QLoRA's refusals."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner


from dstrain.cli import app
from dstrain.config.schema import PEFT_ARGUMENTS, LoraConfig, RunConfig
from dstrain.models import hf
from dstrain.rundir import HF_LORA

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

DOCS = Path(__file__).resolve().parents[1] / "docs" / "fine-tuning.md"


def lora_model(model_dir, **lora):
    config = RunConfig.model_validate({"model": {"name": f"hf:{model_dir}", "lora": lora}})
    return hf.build_pretrained(config, {"zero_optimization": {"stage": 0}}, torch.device("cpu"))


def dry_run(tmp_path, monkeypatch, *sets: str, preset: str = "stage2"):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    args = ["run", "--preset", preset, "--dry-run", "--accelerator", "cpu", "--gpus", "2", "--set", "data.seq_len=16",
            "--set", "train.micro_batch_size=2", "--set", "data.tokenizer=byte"]
    for item in sets:
        args += ["--set", item]
    result = CliRunner().invoke(app, args)
    output = " ".join(result.output.split())
    assert "Traceback" not in output
    return result.exit_code, output


def test_the_docs_table_lists_every_lora_option_with_its_peft_name_and_default():
    table = DOCS.read_text().split("<!-- lora-options -->")[1].split("<!-- /lora-options -->")[0]
    rows = {m[0]: (m[1], m[2]) for m in re.findall(r"\| `(\w+)` \| `([^`]*)` \| `?([\w-]+)`? \|", table)}
    assert set(rows) == set(LoraConfig.model_fields)
    for key, (default, peft_name) in rows.items():
        assert json.loads(default) == LoraConfig.model_fields[key].default, key
        assert peft_name == PEFT_ARGUMENTS.get(key, "-"), key


def test_every_option_reaches_peft_under_its_own_name(llama_dir):
    model = lora_model(llama_dir, r=4, alpha=8, target_modules="all-linear", dropout=0.1,
                       modules_to_save=["lm_head"], use_dora=True, use_rslora=True)
    given = model.model.peft_config["default"]
    assert (given.r, given.lora_alpha, given.lora_dropout, given.use_dora, given.use_rslora) == (4, 8, 0.1, True, True)
    assert given.modules_to_save == ["lm_head"]
    adapted = {name.rsplit(".", 1)[-1] for name in hf.lora_layers(model)}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}  # all-linear
    layers = hf.lora_layers(model)
    assert {layer["scaling"] for layer in layers.values()} == {8 / 4 ** 0.5}  # rsLoRA: alpha / sqrt(r)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any(".lora_magnitude_vector." in n for n in trainable)  # DoRA
    assert any("lm_head.modules_to_save.default.weight" in n for n in trainable)


def test_dry_run_names_unknown_targets_beside_valid_ones_and_lists_the_linear_layers(llama_dir, tmp_path, monkeypatch):
    code, output = dry_run(tmp_path, monkeypatch, f"model.name=hf:{llama_dir}",
                           "model.lora={r: 4, target_modules: [q_proj, qproj, v_proj, attn_out]}",
                           "model.lora.modules_to_save=[lm_haed]", "model.lora.target_parameters=[experts.down_proj]")
    assert code == 2
    assert "model.lora.target_modules: qproj, attn_out: no module of the model has this name" in output
    assert "down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj" in output
    assert "model.lora.modules_to_save: lm_haed" in output
    # a dense model has no fused experts to put adapters on
    assert "model.lora.target_parameters: experts.down_proj: no parameter of the model has this name" in output
    assert "this model has no fused expert weights: use target_modules" in output


@pytest.mark.parametrize("option", ["dropout=0.1", "use_dora=true"])
def test_parameter_adapters_with_dropout_or_dora_are_refused_naming_the_option(llama_dir, tmp_path, monkeypatch, option):
    """peft adds a parameter's adapter to the weight itself: an input dropout or DoRA cannot apply there."""
    code, output = dry_run(tmp_path, monkeypatch, f"model.name=hf:{llama_dir}",
                           f"model.lora={{target_parameters: [mlp.experts.down_proj], {option.replace('=', ': ')}}}")
    assert code == 2 and "Traceback" not in output
    assert f"model.lora.{option.split('=')[0]} does not work with model.lora.target_parameters" in " ".join(output.split())


def test_dry_run_plan_shows_trainable_and_total_parameters(llama_dir, tmp_path, monkeypatch):
    code, output = dry_run(tmp_path, monkeypatch, f"model.name=hf:{llama_dir}",
                           "model.lora={r: 4, target_modules: all-linear, use_dora: true}")
    assert code == 0, output
    model = lora_model(llama_dir, r=4, target_modules="all-linear", use_dora=True)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert 0 < trainable < total
    assert f"{total:,} parameters, {trainable:,} trainable ({100 * trainable / total:.2f}%)" in output


def merged_export(model, model_dir, tmp_path) -> Path:
    """What `convert-checkpoint --format hf` writes for MODEL's weights (its state_dict, as a checkpoint holds it)."""
    from dstrain.tools.convert.hf_folder import folder_from_weights
    source = tmp_path / "hf_source"
    source.mkdir()
    for name in ("config.json", "generation_config.json"):
        (source / name).write_bytes((model_dir / name).read_bytes())
    (source / HF_LORA).write_text(json.dumps(hf.lora_layers(model)))
    save_file({k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}, tmp_path / "w.safetensors")
    folder_from_weights(tmp_path / "w.safetensors", source, tmp_path / "out")
    return tmp_path / "out"


@pytest.mark.parametrize("family, lora", [
    ("llama", {"target_modules": "all-linear", "use_dora": True, "modules_to_save": ["lm_head"]}),
    ("gpt2", {"use_dora": True, "use_rslora": True}),  # Conv1D: transposed layout
])
def test_merged_export_of_dora_and_modules_to_save_gives_the_trained_models_logits(family, lora, llama_dir, gpt2_dir,
                                                                                   tmp_path):
    model_dir = llama_dir if family == "llama" else gpt2_dir
    model = lora_model(model_dir, r=4, **lora)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn_like(p))  # trained: adapters, magnitudes and saved modules moved
    loaded = transformers.AutoModelForCausalLM.from_pretrained(merged_export(model, model_dir, tmp_path))
    inputs = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=inputs).logits, model.model(input_ids=inputs).logits,
                                   rtol=0, atol=1e-5)


def test_adapter_tensors_get_the_names_peft_saves_them_under(llama_dir):
    from dstrain.tools.convert.hf_folder import own_key
    from dstrain.tools.convert.peft_folder import adapter_name
    model = lora_model(llama_dir, r=4, target_modules=["q_proj", "v_proj"], use_dora=True, modules_to_save=["lm_head"])
    ours = {adapter_name(own_key(name)) for name in model.state_dict()} - {None}
    assert ours == set(peft.get_peft_model_state_dict(model.model))


def test_qlora_is_refused_on_cpu_ranks_and_at_zero3(llama_dir, tmp_path, monkeypatch):
    code, output = dry_run(tmp_path, monkeypatch, f"model.name=hf:{llama_dir}", "model.lora={r: 4, quantize: nf4}",
                           preset="stage3")
    assert code == 2
    assert "model.lora.quantize: nf4 quantization runs on CUDA GPUs only" in output
    assert "not supported at ZeRO stage 3" in output and "--preset stage2" in output


def test_qlora_without_bitsandbytes_says_what_to_install(llama_dir, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else find_spec(name, *a))
    config = RunConfig.model_validate({"model": {"name": f"hf:{llama_dir}", "lora": {"quantize": "nf4"}}})
    problems = hf.check_quantize(config, {"zero_optimization": {"stage": 2}}, "cuda")
    assert [(p.where, p.fix) for p in problems] == [("model.lora.quantize", "pip install 'dstrain[qlora]'")]
