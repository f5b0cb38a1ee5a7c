"""Preference objectives in the real training path (issue 52): the loss the model's forward computes
(dstrain.models.preference) against preference_loss's functions on log-probs computed by hand from the
whole logits; the micro batch weighting and metric averaging of the rank (dstrain.rank.preference); one DPO
step with a real deepspeed.initialize per reference mode; and one launcher run (LoRA DPO at ZeRO-2, resumed)."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from dstrain.config.resolve import resolve
from dstrain.data import build_samplers
from dstrain.models import build_model
from dstrain.models import preference_loss as pl
from preference_data import write_zen_pairs

HAS_TRANSFORMERS = __import__("importlib").util.find_spec("transformers") is not None


def gpt_and_sampler(tmp_path, objective: str, *sets: str):
    """The built-in GPT (tiny) with train.objective's loss attached, a frozen copy as its reference, and the
    train sampler of the Zen pairs."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    resolved = resolve(sets=[f"train.objective={objective}", "data.format=preference", "data.source=jsonl",
                             f"data.paths=[{write_zen_pairs(tmp_path / 'pairs.jsonl')}]", "data.tokenizer=byte",
                             f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=128", "model.n_layer=1",
                             "model.n_head=2", "model.d_model=32", "model.vocab_size=256", "train.micro_batch_size=4",
                             *sets], world_size=1, accelerator="cpu", env={})
    train, _ = build_samplers(resolved.config)
    torch.manual_seed(0)
    model = build_model(resolved.config, {}, torch.device("cpu"))
    if objective in ("dpo", "kto"):
        model.preference.reference = copy.deepcopy(model).requires_grad_(False)
    return model, train


def whole_logits_sums(model, batch, prefix="", every_token=False):
    """(summed log-probs, counts) per completion from the GPT's whole fp32 logits: the reference computation."""
    targets, segments = model.preference.targets_of(batch, prefix, every_token)
    with torch.no_grad():
        logits = model.head(model.hidden_states(batch[prefix + "input_ids"], batch[prefix + "position_ids"])).float()
    logps = logits.log_softmax(-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return pl.segment_logps(torch.where(targets != -100, logps, 0.0), segments, len(batch["desirable"]))


def nudge(model):
    with torch.no_grad():
        torch.manual_seed(1)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)


@pytest.mark.parametrize("packing", ["true", "false"])
def test_dpo_forward_is_ln2_at_the_start_and_then_the_dpo_loss_of_the_whole_logits(tmp_path, packing):
    model, train = gpt_and_sampler(tmp_path, "dpo", f"data.packing={packing}", "preference.beta=0.3",
                                   "preference.loss=[sigmoid, ipo]", "preference.loss_weights=[1.0, 0.5]")
    batch = train.batch(0, 4)
    assert model(batch).item() == pytest.approx(math.log(2) + 0.5 * (1 / 0.6) ** 2, rel=1e-6)  # ipo: (0 - 1/2b)^2
    nudge(model)
    loss = model(batch)
    loss.backward()  # the chunked head's backward runs
    (sums, counts), (ref, _) = whole_logits_sums(model, batch), whole_logits_sums(model.preference.reference, batch)
    P = len(batch["margin"])
    expected = pl.dpo_loss(sums[:P], sums[P:], ref[:P], ref[P:], loss_type=["sigmoid", "ipo"], loss_weights=[1.0, 0.5],
                           beta=0.3, chosen_counts=counts[:P], rejected_counts=counts[P:])
    assert loss.item() == pytest.approx(expected.loss.item(), rel=1e-5)
    metrics = model.preference.last_metrics
    assert metrics["rewards/margins"][0].item() == pytest.approx(expected.metrics["rewards/margins"].item(), abs=1e-5)
    assert metrics["rewards/margins"][1] == P


def test_simpo_orpo_and_kto_forwards_match_their_losses_on_the_whole_logits(tmp_path):
    model, train = gpt_and_sampler(tmp_path / "simpo", "simpo", "preference.beta=2.0", "preference.simpo_gamma=0.4")
    batch = train.batch(0, 4)
    P = len(batch["margin"])
    sums, counts = whole_logits_sums(model, batch)
    expected = pl.cpo_loss(sums[:P], sums[P:], counts[:P], counts[P:], loss_type="simpo", beta=2.0, simpo_gamma=0.4,
                           cpo_alpha=0.0)
    assert model(batch).item() == pytest.approx(expected.loss.item(), rel=1e-5)

    model, train = gpt_and_sampler(tmp_path / "orpo", "orpo", "preference.beta=0.2")
    batch = train.batch(0, 4)
    sums, counts = whole_logits_sums(model, batch)
    every, every_counts = whole_logits_sums(model, batch, every_token=True)
    nll = -every[:P].sum() / every_counts[:P].sum()
    expected = pl.orpo_loss(sums[:P], sums[P:], counts[:P], counts[P:], nll, beta=0.2)
    assert model(batch).item() == pytest.approx(expected.loss.item(), rel=1e-5)

    model, train = gpt_and_sampler(tmp_path / "kto", "kto", "preference.beta=0.5")
    nudge(model)
    batch = train.batch(0, 4)
    sums, _ = whole_logits_sums(model, batch)
    ref, _ = whole_logits_sums(model.preference.reference, batch)
    kl = pl.kto_kl_estimate(whole_logits_sums(model, batch, "kl_")[0],
                            whole_logits_sums(model.preference.reference, batch, "kl_")[0])
    expected = pl.kto_loss(sums, ref, batch["desirable"], kl, beta=0.5)
    assert model(batch).item() == pytest.approx(expected.loss.item(), rel=1e-5)
    assert model.preference.last_metrics["kl"][0].item() == pytest.approx(expected.metrics["kl"].item(), abs=1e-6)


def test_packed_micro_batches_are_weighted_by_their_pairs_so_the_step_is_the_mean_over_its_pairs(monkeypatch):
    from dstrain.rank.preference import PreferenceMetrics, micro_batch_weight
    per_pair = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0])]  # two micro batches of 3 and 1 pairs
    batches = [{"margin": torch.zeros(len(p))} for p in per_pair]
    # DeepSpeed averages the micro batches' (weighted) losses: the step's loss is the mean over its 4 pairs
    weighted = [p.mean() * micro_batch_weight(b, 4, 2) for p, b in zip(per_pair, batches)]
    assert (sum(weighted) / 2).item() == pytest.approx(torch.cat(per_pair).mean().item())
    monkeypatch.setattr("dstrain.rank.preference.dist.all_reduce", lambda tensor: None)  # one rank: the sums as they are
    stats = PreferenceMetrics("kto", torch.device("cpu"))
    stats.add({"kl": (torch.tensor(0.2), 1.0), "rewards/chosen": (torch.tensor(1.0), 3.0),
               "logps/chosen": (torch.tensor(-5.0), 3.0), "rewards/rejected": (torch.tensor(0.0), 0.0),
               "logps/rejected": (torch.tensor(0.0), 0.0)})
    stats.add({"kl": (torch.tensor(0.4), 1.0), "rewards/chosen": (torch.tensor(2.0), 1.0),
               "logps/chosen": (torch.tensor(-1.0), 1.0), "rewards/rejected": (torch.tensor(-1.0), 2.0),
               "logps/rejected": (torch.tensor(-9.0), 2.0)})
    out = stats.reduce()
    assert out["rewards/chosen"] == pytest.approx(1.25) and out["rewards/rejected"] == pytest.approx(-1.0)
    assert out["rewards/margins"] == pytest.approx(2.25) and out["kl"] == pytest.approx(0.3)


# --- a real engine on one rank ------------------------------------------------------------------------------

@pytest.mark.integration
@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs transformers and peft")
@pytest.mark.parametrize("reference, preset, sets", [("adapters_off", "stage2", ["model.lora={r: 4, alpha: 8}"]),
                                                     ("model", "stage3", [])])
def test_one_dpo_step_of_a_real_engine_equals_the_dpo_loss_computed_by_hand(tmp_path, reference, preset, sets):
    from one_rank import run_script
    out = run_script("preference_step", {"dir": str(tmp_path), "reference": reference, "preset": preset,
                                          "sets": sets}, timeout=400)
    assert out["first"] == pytest.approx(math.log(2), abs=1e-6)  # policy == reference at the first step
    assert out["moved"] > 1e-3  # the step changed the policy's log-probs
    assert out["engine"] == pytest.approx(out["by_hand"], rel=1e-4, abs=1e-6)


# --- the launcher -------------------------------------------------------------------------------------------

@pytest.mark.integration
@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs transformers and peft")
def test_lora_dpo_trains_through_the_launcher_logs_trls_metrics_saves_and_resumes(tmp_path):
    """`dstrain run` on 2 CPU ranks: DPO, LoRA with the adapters switched off as the reference, ZeRO-2, packed
    Zen pairs. Step 1's loss is ln 2 (policy == reference), the losses stay finite, metrics.jsonl has TRL's
    rewards/* and logps/* (and eval_ ones), a checkpoint is saved, and --resume continues from it."""
    from hf_models import save_tiny_llama
    from launcher import assert_ok, dstrain, losses, run_hf
    run_dir = tmp_path / "run"
    pairs = write_zen_pairs(tmp_path / "pairs.jsonl", repeat=2)
    result = run_hf(run_dir, "stage2", save_tiny_llama(tmp_path / "llama"), "train.objective=dpo",
                    "data.format=preference", "data.source=jsonl", f"data.paths=[{pairs}]",
                    f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=96", "model.lora={r: 4, alpha: 8}",
                    "train.lr=0.02", "train.warmup_steps=0", "train.max_steps=3", "train.eval_every=3",
                    "train.save_every=3", "preference.beta=0.5")
    assert_ok(result)
    assert "reference: the same model with its LoRA adapters switched off" in result.stdout
    trained = losses(run_dir)
    assert sorted(trained) == [1, 2, 3] and all(math.isfinite(v) for v in trained.values())
    assert trained[1] == pytest.approx(math.log(2), abs=1e-5)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "loss" in row]
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected"):
        assert all(key in row for row in steps), key
    assert steps[0]["rewards/margins"] == 0.0 and steps[-1]["rewards/margins"] != 0.0  # the policy moved
    evals = [row for row in rows if "eval_loss" in row]
    assert evals and math.isfinite(evals[-1]["eval_loss"]) and "eval_rewards/accuracies" in evals[-1]
    assert "acc " in result.stdout and "margin " in result.stdout  # the console line
    assert (run_dir / "checkpoints" / "latest").is_file()

    resumed = dstrain("run", "--accelerator", "cpu", "--gpus", "2", "--run-dir", str(run_dir), "--resume", "latest",
                      "--set", "train.max_steps=4")
    assert_ok(resumed)
    assert "resumed from" in resumed.stdout
    after = losses(run_dir)
    assert 4 in after and math.isfinite(after[4])
