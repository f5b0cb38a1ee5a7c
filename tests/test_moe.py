"""Mixture-of-experts models (issue 53): checkpoints in the published per-expert layout load at ZeRO stage 3
through transformers' own conversions, train, and export in the layout they came in."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from dstrain.config.schema import RunConfig  # noqa: E402
from dstrain.errors import UserError  # noqa: E402
from dstrain.models import hf  # noqa: E402
from dstrain.models.conversion import load_router  # noqa: E402
from dstrain.models.weights import load_into, raise_if_incomplete  # noqa: E402
from dstrain.tools.convert.hf_folder import folder_from_weights  # noqa: E402
from hf_families import DENSE_FAMILIES, FAMILIES, save_family  # noqa: E402
from one_rank import run_script  # noqa: E402


def layout(folder) -> dict[str, list[int]]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        return {key: list(handle.get_slice(key).get_shape()) for key in handle.keys()}


@pytest.mark.slow
def test_families_as_published_load_train_and_export_as_published_at_zero3(tmp_path):
    """Qwen3-MoE (12 experts: the fused order is 0..11, not the files' 0, 1, 10, 11, 2 ...), Mixtral
    (block_sparse_moe.experts.<i>.w1/w2/w3, renamed and fused), DeepSeek-V3 (shared experts, a dense first
    layer), and dense Qwen2 (biases), Gemma (tied head), GPT-NeoX (its head saved as embed_out): one ZeRO-3 step
    on two ranks (gloo) with different tokens each, so they route to different experts (and do not hang), the
    checkpoint exported as convert-checkpoint does. The router's balancing loss is on (model.kwargs
    output_router_logits): each rank's loss is transformers' own on its batch, with it.
    Then Qwen3-MoE again with LoRA on its attention and, through peft's target_parameters, on its fused
    experts (every expert's weights partitioned over the ranks): the adapters start at zero, so the first
    loss is still transformers' own; only adapters train; the merged export is the trained model in the
    published per-expert layout, and the peft export loaded by peft on the source model gives its logits."""
    families = [*FAMILIES, *DENSE_FAMILIES]
    lora = {"r": 4, "alpha": 8, "target_modules": ["q_proj"],
            "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
    ranks = run_script("hf_stage3_step", {"families": families, "root": str(tmp_path), "lora": lora,
                                          "lora_families": ["qwen3_moe"],
                                          "model_kwargs": {"output_router_logits": True}}, ranks=2)
    assert [(row["family"], row["lora"]) for row in ranks[0]] == [(f, False) for f in families] + [("qwen3_moe", True)]
    for row in [rows[-1] for rows in ranks]:  # LoRA: adapters on the experts, and only adapters train
        assert row["on_experts"] == ["experts.base_layer.lora_A.default.weight",
                                     "experts.base_layer.lora_B.default.weight",
                                     "experts.lora_A.default.weight", "experts.lora_B.default.weight"], row
        assert row["trainable_outside"] == [] and row["experts_b_moved"] > 1e-3, row
        assert row["peft_vs_trained"] < 1e-5, row
    assert ranks[0][0]["loss"] != ranks[1][0]["loss"]  # different data
    for row in [row for rows in ranks for row in rows]:
        assert (row["per_expert_keys"] > 0) is (row["family"] in FAMILIES), row  # the published layout
        assert row["loss"] == pytest.approx(row["expected"], abs=1e-6), row  # transformers' own model, same batch
        assert row["same_layout"], row  # the export's keys and shapes are the source's (GPT-NeoX: embed_out)
        assert row["export_vs_trained"] < 1e-5, row  # from_pretrained of the export is the trained model
        assert row["trained_moved"] > 1e-3, row  # the step changed the weights the export holds
        router = row["router"]
        if row["family"] in DENSE_FAMILIES:
            assert router is None, row
            continue
        # every token goes to top_k experts in every MoE layer; the busiest expert has at least the mean
        assert sum(router["expert_tokens"]) == row["ranks"] * row["tokens"] * row["top_k"] * row["moe_layers"], row
        assert router["expert_load"] >= 1.0, row
        if row["family"] == "deepseek_v3":  # balanced by its routing bias, no balancing loss in transformers
            assert "aux_loss" not in router, row
        else:  # logged apart: the LM loss and the balancing loss make the loss
            assert router["aux_loss"] > 0, row
            # over both ranks: the mean of their losses
            mean = sum(r["loss"] for rows in ranks for r in rows if (r["family"], r["lora"]) == (row["family"], row["lora"])) / 2
            assert router["lm_loss"] + row["coef"] * router["aux_loss"] == pytest.approx(mean, abs=1e-5), row


def zero_model(folder):
    """FOLDER's architecture with every weight zero (fused experts), as the loader gets it before the copy."""
    config = transformers.AutoConfig.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    return model


@pytest.mark.slow
def test_the_loader_fuses_per_expert_tensors_as_from_pretrained_does(tmp_path):
    folder = save_family("qwen3_moe", tmp_path / "moe")
    model = zero_model(folder)
    report = load_into(model, [folder / "model.safetensors"], load_router(model), zero3=False)
    assert report.missing == report.unexpected == report.mismatched == []
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder)
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


@pytest.mark.parametrize("drop, problem", [
    # 12 gate_proj but 11 up_proj tensors do not concatenate
    ("model.layers.1.mlp.experts.7.up_proj.weight", "model.layers.1.mlp.experts.gate_up_proj: transformers' "
                                                    "conversion of 23 tensors"),
    # 11 experts of each: fused, one expert short
    ("model.layers.1.mlp.experts.7.", "model.layers.1.mlp.experts.gate_up_proj: [11, 32, 32] in the file (from 22 "
                                      "tensors), [12, 32, 32] in the model"),
    (".mlp.experts.", "missing from the weights: model.layers.0.mlp.experts.gate_up_proj"),
])
def test_a_checkpoint_that_misses_expert_tensors_stops_the_load_naming_the_fused_parameter(tmp_path, drop, problem):
    folder = save_family("qwen3_moe", tmp_path / "moe")
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        weights = {key: handle.get_tensor(key) for key in handle.keys() if drop not in key}
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    model = zero_model(folder)
    report = load_into(model, [folder / "model.safetensors"], load_router(model), zero3=False)
    with pytest.raises(UserError) as err:
        raise_if_incomplete(report, "model.name: hf:moe", "fix")
    assert problem in str(err.value)


def exported_layout(folder, source, tmp_path, keys_recorded=True):
    """Export the model that SOURCE loads into as the run's hf_source/ of SOURCE would: its layout."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    save_file({f"model.{k}": v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "trained.safetensors")
    config = RunConfig.model_validate({"model": {"name": f"hf:{source}"}})
    hf.save_source(config, tmp_path / "run")
    if not keys_recorded:  # a run directory from before the source's keys were recorded
        (tmp_path / "run" / "hf_source" / "dstrain_source_keys.json").unlink()
    out = tmp_path / "exported"
    folder_from_weights(tmp_path / "trained.safetensors", tmp_path / "run" / "hf_source", out)
    inputs = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        difference = (transformers.AutoModelForCausalLM.from_pretrained(out)(input_ids=inputs).logits
                      - model(input_ids=inputs).logits).abs().max().item()
    assert difference == 0.0
    return layout(out)


def test_the_export_writes_the_sources_layout_fused_when_it_was_fused(tmp_path):
    folder = save_family("mixtral", tmp_path / "moe")
    fused = tmp_path / "fused"  # the same weights as transformers 5 holds them (what an older export wrote)
    fused.mkdir()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, fused / "model.safetensors",
              metadata={"format": "pt"})
    shutil.copy(folder / "config.json", fused)
    assert "model.layers.0.mlp.experts.gate_up_proj" in layout(fused)
    assert exported_layout(fused, fused, tmp_path) == layout(fused)


def test_an_export_without_the_sources_keys_writes_the_published_layout_as_save_pretrained(tmp_path):
    folder = save_family("mixtral", tmp_path / "moe")
    assert exported_layout(folder, folder, tmp_path, keys_recorded=False) == layout(folder)


def test_the_run_directory_records_the_sources_weight_keys(tmp_path):
    folder = save_family("deepseek_v3", tmp_path / "moe")
    hf.save_source(RunConfig.model_validate({"model": {"name": f"hf:{folder}"}}), tmp_path / "run")
    keys = json.loads((tmp_path / "run" / "hf_source" / "dstrain_source_keys.json").read_text())["keys"]
    assert keys == sorted(layout(folder))


def test_the_balancing_loss_enters_dstrains_own_loss_as_transformers_adds_it(tmp_path):
    """Batches of (inputs, shifted targets), whose LM loss dstrain computes: the loss is transformers' with
    labels (the LM loss plus router_aux_loss_coef x aux_loss); the window's values say both parts; evaluation
    forwards count in neither."""
    folder = save_family("mixtral", tmp_path / "moe")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, output_router_logits=True, router_aux_loss_coef=0.5)
    inputs = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    targets = torch.cat([inputs[:, 1:], torch.full((2, 1), -100)], dim=1)
    with torch.no_grad():
        expected = model(input_ids=inputs, labels=inputs)
        wrapped = hf.CausalLM(model).train()
        loss = wrapped((inputs, targets))
        wrapped.eval()
        wrapped((inputs, targets))  # an evaluation: not in the window
    assert loss.item() == pytest.approx(expected.loss.item(), abs=1e-5)
    values = wrapped.router_stats.reduce()
    assert values["aux_loss"] == pytest.approx(expected.aux_loss.item(), abs=1e-6)
    assert values["lm_loss"] == pytest.approx(expected.loss.item() - 0.5 * expected.aux_loss.item(), abs=1e-5)
    assert sum(values["expert_tokens"]) == inputs.numel() * 2 * 2  # top-2 experts, 2 MoE layers
    assert wrapped.router_stats.reduce() == {}  # reduce starts a new window


def test_a_model_without_experts_keeps_no_router_stats(tmp_path):
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    assert hf.CausalLM(transformers.AutoModelForCausalLM.from_config(config)).router_stats is None


def test_the_experts_load_goes_to_metrics_jsonl_the_trackers_numbers_and_dstrain_report(tmp_path):
    from typer.testing import CliRunner

    from dstrain.cli import app
    from dstrain.rank.metrics import MetricsLog
    from dstrain.rank.trackers import open_trackers
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    metrics = MetricsLog(run_dir, True, max_steps=2, tokens_per_step=64, flops_per_token=1e6, world=1,
                         device=torch.device("cpu"), trackers=open_trackers(["csv"], run_dir, {}, 0))
    metrics.start(0)
    for step in (1, 2):
        metrics.log_step(step, 3.0, 1e-3, elapsed=0.5, steps=1, stats={
            "lm_loss": 2.99, "aux_loss": 2.0 + step, "expert_load": 1.5, "expert_tokens": [40, 30, 20, 30]})
    metrics.finish(type("State", (), {"step": 2, "stopped_by": None})())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[1]["expert_tokens"] == [40, 30, 20, 30] and rows[1]["aux_loss"] == 3.0
    csv_text = (run_dir / "metrics.csv").read_text()
    assert "expert_load" in csv_text and "expert_tokens" not in csv_text  # trackers get the numbers
    result = CliRunner().invoke(app, ["report", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert "run: experts' load 1.5 (max/mean) at step 2, balancing loss 4, tokens per expert 40 30 20 30" in result.output
    assert (run_dir / "report-expert_load.png").is_file() and (run_dir / "report-moe_loss.png").is_file()


# ------------------------------------------------------------------ estimate: total for memory, active for compute


def test_estimate_holds_a_moe_shapes_total_parameters_in_memory_and_counts_its_active_ones_for_compute():
    from dstrain.tools.estimate.planner import make_plan
    dense = make_plan(None, [], 30e9, 8, 1, 80, 1024, "cuda")
    moe = make_plan(None, [], "30e9/3e9", 8, 1, 80, 1024, "cuda")
    assert moe.workload.params == dense.workload.params == int(30e9)
    assert moe.workload.active_params == int(3e9) and dense.workload.active_params == int(30e9)
    # the memory is the total's: every preset's estimate as the dense model's of the same size
    assert [e.gpu_bytes_per_gpu for e in moe.estimates] == [e.gpu_bytes_per_gpu for e in dense.estimates]
    assert any("compute for the 3e+09 a token runs through" in note for note in moe.notes)


@pytest.mark.parametrize("value, problem", [("3e9/30e9", "the active part at most the total"),
                                            ("thirty", "not a parameter count")])
def test_estimate_names_a_params_value_it_cannot_read(value, problem):
    from dstrain.tools.estimate.planner import make_plan
    with pytest.raises(UserError, match=problem) as err:
        make_plan(None, [], value, 8, 1, 80, 1024, "cuda")
    assert err.value.problems[0].where == "--params" and "30e9/3e9" in err.value.problems[0].fix


def test_estimate_of_an_hf_moe_folder_counts_the_experts_a_token_runs_through(tmp_path):
    from dstrain.models import flops_per_token
    from dstrain.tools.estimate.planner import make_plan
    folder = save_family("qwen3_moe", tmp_path / "moe")
    plan = make_plan(None, ["data.tokenizer=byte"], f"hf:{folder}", 1, 1, 80, 64, "cuda")
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder)
    total = sum(p.numel() for p in reference.parameters())
    experts = sum(p.numel() for name, p in reference.named_parameters() if ".mlp.experts." in name)
    assert plan.workload.params == total
    assert plan.workload.active_params == total - experts * (12 - 2) // 12  # top-2 of 12 experts
    # a run's MFU counts the same: 6 x (active parameters - the embedding lookup) + attention
    config = RunConfig.model_validate({"model": {"name": f"hf:{folder}"}, "data": {"seq_len": 16}})
    lookup = reference.get_input_embeddings().weight.numel()
    assert flops_per_token(hf.CausalLM(reference), config, total) == (
        6.0 * (plan.workload.active_params - lookup) + 12.0 * 2 * 32 * 16)


# ------------------------------------------------------------------ LoRA and packing on a MoE model


@pytest.mark.slow
def test_lora_on_a_moe_models_attention_and_experts_trains_packed_rows_and_merges_into_the_published_layout(tmp_path):
    """Adapters on q_proj/v_proj of Qwen3-MoE and on its fused experts (peft's target_parameters: a rank-4
    adapter per expert; the base weights frozen), a packed dict batch (two examples told apart by their
    position ids) with the balancing loss on, and the export: the merged weights in the source's per-expert
    layout, the logits of peft's own merge."""
    from safetensors.torch import save_file as save

    from dstrain.rundir import HF_LORA
    folder = save_family("qwen3_moe", tmp_path / "moe")
    config = RunConfig.model_validate({"model": {"name": f"hf:{folder}", "kwargs": {"output_router_logits": True},
                                                 "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"],
                                                          "target_parameters": ["gate_up_proj", "down_proj"]}}})
    model = hf.build_pretrained(config, {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}},
                                torch.device("cpu")).train()
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        n for n in dict(model.named_parameters()) if ".lora_" in n}
    assert sum(".mlp.experts." in n and "lora_A" in n for n, _ in model.named_parameters()) == 2 * 2  # 2 layers
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)  # a trained adapter
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(5))
    batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.cat([torch.arange(5), torch.arange(7)])[None]}
    batch["labels"][0, 5] = -100  # the second example's first token predicts nothing from the first
    loss = model(batch)
    loss.backward()
    assert torch.isfinite(loss) and model.router_stats.reduce()["aux_loss"] > 0
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_A" in n)

    save({k: v.detach().contiguous() for k, v in model.state_dict().items()}, tmp_path / "w.safetensors")
    hf.save_source(config, tmp_path / "run")
    (tmp_path / "run" / "hf_source" / HF_LORA).write_text(json.dumps(hf.lora_layers(model)))
    folder_from_weights(tmp_path / "w.safetensors", tmp_path / "run" / "hf_source", tmp_path / "out")
    assert layout(tmp_path / "out") == layout(folder)
    merged = model.model.merge_and_unload().eval()
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert (exported(input_ids=ids).logits - merged(input_ids=ids).logits).abs().max().item() < 1e-5


def test_a_transformers_without_the_loading_functions_is_refused_naming_the_version_where_it_needs_them(monkeypatch):
    """transformers 5.17 has the conversion mapping but no apply_renamings: a clear exit, not an ImportError
    in every rank."""
    from transformers import core_model_loading

    from dstrain.errors import UserError
    from dstrain.models import conversion
    monkeypatch.delattr(core_model_loading, "apply_renamings")
    with pytest.raises(UserError) as refused:
        conversion._require_loading_functions()
    assert "apply_renamings" in str(refused.value) and transformers.__version__ in str(refused.value)

    # What the loader does there: a model stored in its own layout loads (only legacy renamings in its
    # mapping), one whose layers transformers converts is refused with that message.
    from hf_families import config_of
    with torch.device("meta"):
        dense = transformers.AutoModelForCausalLM.from_config(config_of("qwen2"))
        moe = transformers.AutoModelForCausalLM.from_config(config_of("qwen3_moe"))
    stored = [conversion.StoredTensor(name, tuple(t.shape), lambda: None) for name, t in dense.state_dict().items()]
    groups, unexpected = conversion.load_router(dense)(stored, set(dense.state_dict()))
    assert unexpected == [] and sorted(g.target for g in groups) == sorted(dense.state_dict())
    with pytest.raises(UserError) as refused:
        conversion.load_router(moe)
    assert "apply_renamings" in str(refused.value)
