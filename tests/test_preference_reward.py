"""Reward models (train.objective reward, issue 52): an hf: causal LM built as transformers'
AutoModelForSequenceClassification with one label, the reward of a completion read at its last token, the
Bradley-Terry loss of preference_loss.reward_loss, and the export that from_pretrained loads back."""

from __future__ import annotations

import json

import pytest
import torch

from dstrain.config.resolve import resolve
from dstrain.data import build_samplers
from dstrain.models import build_model
from dstrain.models import preference_loss as pl
from preference_data import write_zen_pairs

transformers = pytest.importorskip("transformers")


def margin_pairs(path):
    """The Zen pairs with a per-pair margin on every other row (rows without one have none)."""
    rows = [json.loads(line) for line in write_zen_pairs(path).read_text().splitlines()]
    for i, row in enumerate(rows):
        if i % 2 == 0:
            row["margin"] = 0.25 * (i % 5)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def reward_model_and_sampler(tmp_path, *sets: str):
    from hf_models import save_tiny_llama
    llama = save_tiny_llama(tmp_path / "llama")
    resolved = resolve(sets=["train.objective=reward", "data.format=preference", "data.source=jsonl",
                             f"data.paths=[{margin_pairs(tmp_path / 'pairs.jsonl')}]", "data.tokenizer=byte",
                             f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=128", f"model.name=hf:{llama}",
                             "train.micro_batch_size=4", *sets], world_size=1, accelerator="cpu", env={})
    train, _ = build_samplers(resolved.config)
    torch.manual_seed(0)
    model = build_model(resolved.config, {}, torch.device("cpu"))
    return model, train, llama, resolved.config


def own_scores(hf_model, batch) -> torch.Tensor:
    """Each completion's score from transformers' own forward: the example alone in a row of its own, the
    classifier's pooled logit (at the last token)."""
    ids, examples = batch["input_ids"], batch["example_ids"]
    scores = []
    for segment in range(int(examples.max()) + 1):
        tokens = ids[examples == segment].unsqueeze(0)
        with torch.no_grad():
            scores.append(hf_model(input_ids=tokens).logits[0, 0])
    return torch.stack(scores)


@pytest.mark.parametrize("packing", ["true", "false"])
def test_reward_forward_is_reward_loss_on_the_scores_of_transformers_own_classifier(tmp_path, packing):
    model, train, llama, config = reward_model_and_sampler(tmp_path, f"data.packing={packing}",
                                                           "preference.center_rewards_coefficient=0.01")
    inner = model.model
    assert type(inner).__name__ == "LlamaForSequenceClassification" and inner.config.num_labels == 1
    assert inner.config.pad_token_id is not None
    batch = train.batch(0, 4)
    assert bool((batch["margin"] != 0).any())
    loss = model(batch)
    loss.backward()
    assert inner.score.weight.grad is not None and inner.score.weight.grad.abs().sum() > 0

    reference = transformers.AutoModelForSequenceClassification.from_pretrained(
        llama, num_labels=1, pad_token_id=inner.config.pad_token_id, dtype=torch.float32).eval()
    reference.score.load_state_dict(inner.score.state_dict())
    scores = own_scores(reference, batch)
    P = len(batch["margin"])
    expected = pl.reward_loss(scores[:P], scores[P:], batch["margin"], 0.01)
    assert loss.item() == pytest.approx(expected.loss.item(), rel=1e-5)
    metrics = model.preference.last_metrics
    for name in ("accuracy", "margin", "mean_reward"):
        assert metrics[name][0].item() == pytest.approx(expected.metrics[name].item(), abs=1e-5)
        assert metrics[name][1] == P


def test_the_score_head_is_new_and_initialised_as_transformers_does(tmp_path):
    model, _, llama, _ = reward_model_and_sampler(tmp_path)
    weight = model.model.score.weight
    assert weight.shape == (1, 32) and 0 < weight.std().item() < 0.1  # normal(0, initializer_range 0.02)
    causal = transformers.AutoModelForCausalLM.from_pretrained(llama)
    assert torch.equal(model.model.model.embed_tokens.weight, causal.model.embed_tokens.weight)  # the rest loaded


def test_lora_on_a_reward_model_keeps_the_score_head_trainable(tmp_path):
    model, train, _, _ = reward_model_and_sampler(tmp_path, "model.lora={r: 4, alpha: 8}")
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert any("score" in name and "modules_to_save" in name for name in trainable)
    assert any("lora_A" in name for name in trainable)
    assert not any("embed_tokens" in name for name in trainable)
    model(train.batch(0, 4)).backward()


def test_the_hf_export_of_a_reward_model_loads_as_a_classifier_with_the_same_scores(tmp_path):
    """A dstrain state dict (the wrapper's names; what a checkpoint consolidates to) through the hf folder writer, with the run's hf_source/
    config: AutoModelForSequenceClassification.from_pretrained gives the trained model's scores."""
    from safetensors.torch import save_file

    from dstrain.models.hf import save_source
    from dstrain.tools.convert.hf_folder import write_folder
    model, train, _, config = reward_model_and_sampler(tmp_path)
    with torch.no_grad():
        model.model.score.weight.add_(0.5)  # "trained": not the fresh initialisation
    run_dir = tmp_path / "run"
    save_source(config, run_dir)
    source = json.loads((run_dir / "hf_source" / "config.json").read_text())
    assert source["architectures"] == ["LlamaForSequenceClassification"] and len(source["id2label"]) == 1
    weights = tmp_path / "consolidated.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(weights))
    (tmp_path / "export").mkdir()
    export = write_folder(weights, run_dir / "hf_source", tmp_path / "export", "fp32", None)
    assert "AutoModelForSequenceClassification" in export.summary()
    loaded = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "export").eval()
    batch = train.batch(0, 4)
    with torch.no_grad():
        mine = model.scores(batch["input_ids"], batch["position_ids"])
        theirs = loaded.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])[0]
        theirs = loaded.score(theirs).squeeze(-1)
    assert torch.allclose(mine, theirs, atol=1e-5)


@pytest.mark.integration
def test_a_zero3_reward_engine_loads_the_body_tensor_by_tensor_initialises_the_score_and_computes_the_loss(tmp_path):
    """Stage 3 (zero.Init, weights copied one tensor at a time, the score head initialised on rank 0): the
    engine's loss equals reward_loss on the scores of transformers' own classifier given the same score head,
    and the head is not all zeros (it was initialised, not left as zero.Init made it)."""
    from hf_models import save_tiny_llama
    from one_rank import run_one_rank
    llama = save_tiny_llama(tmp_path / "llama")
    pairs = margin_pairs(tmp_path / "pairs.jsonl")
    out = run_one_rank(f"""
        sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent)!r})
        from dstrain.config.resolve import resolve
        from dstrain.data import build_samplers
        from dstrain.models import build_model
        from dstrain.models import preference_loss as pl
        from dstrain.rank.runtime import initialize_engine
        from test_preference_reward import own_scores
        import transformers
        sets = ["train.objective=reward", "data.format=preference", "data.source=jsonl", "data.paths=[{pairs}]",
                "data.tokenizer=byte", "data.cache_dir={tmp_path / 'cache'}", "data.seq_len=128",
                "model.name=hf:{llama}", "train.micro_batch_size=4", "train.activation_checkpointing=false"]
        resolved = resolve("stage3", None, sets, world_size=1, accelerator="cpu", env={{}})
        train, _ = build_samplers(resolved.config)
        model = build_model(resolved.config, resolved.ds_config, torch.device("cpu"))
        engine = initialize_engine(model, resolved.ds_config)
        batch = train.batch(0, 4)
        with torch.no_grad():
            loss = engine(batch).item()
        with deepspeed.zero.GatheredParameters(list(model.model.score.parameters())):
            score = model.model.score.weight.detach().clone()
        reference = transformers.AutoModelForSequenceClassification.from_pretrained(
            "{llama}", num_labels=1, pad_token_id=model.model.config.pad_token_id, dtype=torch.float32).eval()
        reference.score.weight.data.copy_(score)
        scores = own_scores(reference, batch)
        P = len(batch["margin"])
        result({{"loss": loss, "expected": pl.reward_loss(scores[:P], scores[P:], batch["margin"]).loss.item(),
                 "score_std": score.std().item()}})
    """, timeout=400)
    assert out["loss"] == pytest.approx(out["expected"], rel=1e-5)
    assert 0 < out["score_std"] < 0.1
